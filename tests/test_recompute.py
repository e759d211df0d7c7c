"""Activation recomputation (--recompute-*): what is recomputed, and that it changes nothing.

A run with recomputation must give bitwise the same losses, gradients and weights as one without (CPU,
fp32, dropout ON so the replay of both random streams is exercised), under every pipeline method:
the synchronous ones (gpipe, 1f1b, interleaved 1f1b) through the executor's emulator, the asynchronous
ones (async-naive, pipedream, pipedream-2bw, spectrain, pipeoptim) through the AsyncEmulator, where the
weights change between a micro-batch's forward and backward and the policy must re-install the forward's
weights around the recomputation. `test_without_the_policy_hook_recomputation_is_wrong` shows the
comparison would catch a recomputation on the wrong weights. Tolerance: exact (torch.equal).
"""

import dataclasses

import pytest
import torch
import torch._dynamo  # noqa: F401  (model init imports it lazily, ~1 s: once here, not in forked ranks)
from dist_harness import run_distributed
from test_async_policies import LR, SEED, VOCAB, get_batch, lr_fn_for, make_cfg
from test_transformer_engine import fake_te, one_thread  # noqa: F401  (fixtures: the fake TE; one thread, autouse)

from megatron_po.models.gpt import GPTModel, masked_mean_loss
from megatron_po.models.recompute import layer_groups
from megatron_po.models.transformer import MLP, SelfAttention, TransformerLayer
from megatron_po.pipeline.async_pipeline import AsyncEmulator, AsyncPipelineRank
from megatron_po.pipeline.executor import Mailbox, StageRunner, emulate
from megatron_po.pipeline.partition import build_chunks_for_rank
from megatron_po.pipeline.schedules import build_schedule
from megatron_po.tensor_parallel import model_parallel_seed

FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
BLOCK = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
SELECTIVE = dict(recompute_activations=True)
NONE = {}
GRANULARITIES = {"full-uniform": FULL, "full-block": BLOCK, "selective": SELECTIVE}


def with_recompute(cfg, recompute: dict, dropout: float = 0.1):
    cfg.model = dataclasses.replace(cfg.model, hidden_dropout=dropout, attention_dropout=dropout, **recompute)
    return cfg


def assert_same(a, b, what):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            assert_same(a[k], b[k], f"{what}[{k}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    else:
        assert a == b, what


# ---- what is recomputed ----------------------------------------------------------------------------------

def test_layer_groups_follow_megatron():
    cfg = make_cfg(5).model
    assert layer_groups(cfg, 5) == [(0, 5, False)]
    assert layer_groups(dataclasses.replace(cfg, **SELECTIVE), 5) == [(0, 5, False)]
    uniform = dataclasses.replace(cfg, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    assert layer_groups(uniform, 5) == [(0, 2, True), (2, 4, True), (4, 5, True)]  # last group shorter
    block = dataclasses.replace(uniform, recompute_method="block")
    assert layer_groups(block, 5) == [(0, 1, True), (1, 2, True), (2, 5, False)]
    assert layer_groups(block, 1) == [(0, 1, True)]  # N beyond the chunk: every layer
    assert layer_groups(uniform, 0) == []


def count_calls(module_type, method="forward"):
    calls = []
    original = getattr(module_type, method)

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)
    return calls, original, counted


@pytest.mark.parametrize("name,recompute,module,method,train_calls", [
    ("none", NONE, TransformerLayer, "forward", 3),
    ("full-uniform-2", dict(FULL, recompute_num_layers=2), TransformerLayer, "forward", 6),
    ("full-block-1", BLOCK, TransformerLayer, "forward", 4),
    ("selective", SELECTIVE, SelfAttention, "core_attention", 6),
    ("selective-granularity", dict(recompute_granularity="selective"), SelfAttention, "core_attention", 6),
    # --recompute-modules (Megatron's names): core_attn is the attention core; moe alone leaves it kept
    ("modules-core-attn", dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe"]),
     SelfAttention, "core_attention", 6),
    ("modules-moe-only", dict(recompute_granularity="selective", recompute_modules=["moe"]), SelfAttention,
     "core_attention", 3),
    ("modules-without-selective", dict(recompute_modules=["core_attn"]), SelfAttention, "core_attention", 3),
    ("modules-mlp", dict(recompute_granularity="selective", recompute_modules=["mlp"]), MLP, "compute", 6),
    ("modules-core-attn-only", dict(recompute_granularity="selective"), MLP, "compute", 3),
])
def test_recomputed_parts_run_twice_in_training_once_in_eval(monkeypatch, name, recompute, module, method,
                                                              train_calls):
    model_parallel_seed(SEED)
    cfg = with_recompute(make_cfg(3), recompute)
    model = GPTModel(cfg.model, VOCAB, SEED)
    calls, original, counted = count_calls(module, method)
    monkeypatch.setattr(module, method, counted)
    b = get_batch(0)
    loss = masked_mean_loss(model(input_ids=b["tokens"], labels=b["labels"]), b["loss_mask"])
    loss.backward()
    assert len(calls) == train_calls
    calls.clear()
    model.eval()
    with torch.no_grad():
        model(input_ids=b["tokens"], labels=b["labels"])
    assert len(calls) == 3  # evaluation never recomputes


def single_model_run(recompute, rope=False):
    model_parallel_seed(SEED)
    cfg = with_recompute(make_cfg(3), recompute, dropout=0.2)
    if rope:
        cfg.model = dataclasses.replace(cfg.model, position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
    model = GPTModel(cfg.model, VOCAB, SEED)
    losses = []
    for mb in range(2):
        b = get_batch(mb)
        loss = masked_mean_loss(model(input_ids=b["tokens"], labels=b["labels"]), b["loss_mask"])
        loss.backward()
        losses.append(loss.detach())
    grads = {k: p.grad for k, p in model.named_parameters()}
    return losses, grads, torch.get_rng_state()


@pytest.mark.parametrize("rope", [False, True], ids=["gpt2", "llama"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_single_model_bitwise(granularity, rope):
    """Losses, gradients and the random stream after the step are those of the run without it."""
    assert_same(single_model_run(GRANULARITIES[granularity], rope), single_model_run(NONE, rope), granularity)


MODULES_MLP = dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])


@pytest.mark.parametrize("rope", [False, True], ids=["gpt2", "llama"])
def test_recompute_modules_mlp_bitwise(rope):
    """--recompute-modules core_attn mlp (Megatron-core's names): the attention core and the dense MLP recomputed,
    the same losses, gradients and random stream as without."""
    assert_same(single_model_run(MODULES_MLP, rope), single_model_run(NONE, rope), "mlp")


# ---- synchronous pipelines (executor emulator) -----------------------------------------------------------

def sync_pipeline_run(method, D, v, recompute, M=4):
    model_parallel_seed(SEED)
    cfg = with_recompute(make_cfg(2 * D * v), recompute)
    mailbox, runners = Mailbox(), {}
    for r in range(D):
        runners[r] = StageRunner(rank=r, num_stages=D, chunks=build_chunks_for_rank(cfg, VOCAB, r, D, v),
                                 transport=mailbox, get_batch=get_batch, loss_scale=1.0 / M)
    emulate(build_schedule(method, D, v, M), runners)
    holder = next(runner for runner in runners.values() if runner.losses)  # the last stage (ZB-V: rank 0)
    losses = [holder.losses[m] for m in range(M)]
    grads = {(r, c, k): p.grad for r in range(D) for c, chunk in enumerate(runners[r].chunks)
             for k, p in chunk.named_parameters()}
    return losses, grads


@pytest.mark.parametrize("method,D,v", [("gpipe", 2, 1), ("1f1b", 2, 1), ("1f1b", 2, 2)],
                         ids=["gpipe", "1f1b", "interleaved-1f1b"])
@pytest.mark.parametrize("granularity", ["full-uniform", "selective"])
def test_synchronous_pipelines_bitwise(method, D, v, granularity):
    assert_same(sync_pipeline_run(method, D, v, GRANULARITIES[granularity]), sync_pipeline_run(method, D, v, NONE),
                f"{method} {granularity}")


# ---- asynchronous pipelines (AsyncEmulator): the policy re-installs the forward's weights ------------------

ASYNC = {  # method: (optimizer, update interval k, policy options)
    "async-naive": ("adam", 1, {}),
    "pipedream": ("adam", 1, {}),
    "pipedream-2bw": ("adam", 3, {}),
    "spectrain": ("sgd", 1, {}),
    "pipeoptim": ("adam", 1, {}),
    "pipeoptim-s_offset1": ("adam", 1, {"s_offset": 1}),
}


def async_run(method, recompute, D=3, v=1, segment=9, policy_hook=True, impl="local", precision=None):
    optimizer, k, options = ASYNC[method]
    model_parallel_seed(SEED)
    cfg = with_recompute(make_cfg(D * v), recompute)
    cfg.model.transformer_impl = impl
    for key, value in (precision or {}).items():
        setattr(cfg.precision, key, value)
    kwargs = {"lr": LR[optimizer], "weight_decay": 0.01, "sgd_momentum": 0.9}
    emu = AsyncEmulator(cfg, VOCAB, method.split("-s_")[0], D, v, k, optimizer, kwargs, lr_fn_for(optimizer),
                        0.0, **options)
    grads = []
    for stage in emu.stages:
        if not policy_hook:
            stage.policy.weights_for_recompute = lambda mb, chunk: None
        step = stage.step

        def recorded(c, stage=stage, step=step):  # every gradient a step applies, in order
            grads.append((stage.rank, c, [p.grad.clone() for p in stage.params[c] if p.grad is not None]))
            step(c)
        stage.step = recorded
    losses = emu.train_segment(get_batch, segment)
    return losses, grads, emu.full_state_dict(), emu.copies_per_chunk()


@pytest.mark.parametrize("method", list(ASYNC))
@pytest.mark.parametrize("granularity", ["full-uniform", "selective"])
def test_asynchronous_methods_bitwise(method, granularity):
    losses, grads, weights, copies = async_run(method, GRANULARITIES[granularity])
    ref_losses, ref_grads, ref_weights, ref_copies = async_run(method, NONE)
    assert_same(losses, ref_losses, "losses")
    assert_same(grads, ref_grads, "gradients")
    assert_same(weights, ref_weights, "weights")
    # Weights kept for recomputation: only where the backward runs on other weights than the forward,
    # and never on the last stage (s = 0) unless PipeOptim predicts ahead anyway (s_offset 1). There the
    # chunked output loss (--chunked-output-loss) keeps the output layer's forward weights in the run without
    # recomputation too, which the count (whole copies of the chunk, rounded up) already counts as one more.
    keeps = granularity == "full-uniform" and method not in ("pipedream", "pipedream-2bw")
    for (r, c), n in copies.items():
        if r == 2 and method == "pipeoptim-s_offset1":
            assert n == ref_copies[(r, c)] == 3, (r, c, n, ref_copies[(r, c)])  # live, prediction, kept
            continue
        expect_more = keeps and r < 2
        assert (n > ref_copies[(r, c)]) == expect_more, (r, c, n, ref_copies[(r, c)])


def test_pipeoptim_recompute_modules_mlp_bitwise():
    """The recomputed MLP reads the weights its forward predicted, not the live ones the backward sees."""
    assert_same(async_run("pipeoptim", MODULES_MLP)[:3], async_run("pipeoptim", NONE)[:3], "pipeoptim mlp")


def test_interleaved_pipeoptim_bitwise():
    run = lambda recompute: async_run("pipeoptim", recompute, D=2, v=2, segment=8)  # noqa: E731
    assert_same(run(BLOCK)[:3], run(NONE)[:3], "interleaved pipeoptim")  # losses, gradients, weights


@pytest.mark.parametrize("precision", [dict(bf16=True), dict(bf16=True, use_distributed_optimizer=True)],
                         ids=["bf16", "bf16-distributed-optimizer"])
def test_pipeoptim_mixed_precision_bitwise(precision):
    """Predictions written into the low-precision model weights (main params elsewhere): same result."""
    run = lambda recompute: async_run("pipeoptim", recompute, precision=precision)[:3]  # noqa: E731
    assert_same(run(FULL), run(NONE), f"pipeoptim {precision}")


@pytest.mark.parametrize("method", ["pipeoptim", "spectrain", "async-naive"])
def test_without_the_policy_hook_recomputation_is_wrong(method):
    """Recomputing on the backward's weights (no hook) changes the gradients: the bitwise tests can fail."""
    _, grads, _, _ = async_run(method, FULL, policy_hook=False)
    _, ref_grads, _, _ = async_run(method, NONE)
    with pytest.raises(AssertionError):
        assert_same(grads, ref_grads, "gradients")


# ---- Transformer Engine layers (tests/fake_transformer_engine.py): the policies' in-place weight path ------

@pytest.mark.parametrize("granularity", ["full-uniform", "selective"])
def test_transformer_engine_pipeoptim_bitwise(fake_te, granularity):
    fake_te.CALLS.clear()
    recomputed = async_run("pipeoptim", GRANULARITIES[granularity], impl="transformer_engine")
    attention_calls = sum(1 for name, _ in fake_te.CALLS if name == "DotProductAttention")
    fake_te.CALLS.clear()
    plain = async_run("pipeoptim", NONE, impl="transformer_engine")
    assert attention_calls == 2 * sum(1 for name, _ in fake_te.CALLS if name == "DotProductAttention")
    assert_same(recomputed[:3], plain[:3], f"TE {granularity}")


# ---- distributed: TP=2 x PP=2 with sequence parallelism (TP-split dropout through the tracker) --------------

def distributed_async(recompute):
    model_parallel_seed(SEED)
    cfg = with_recompute(make_cfg(2), recompute)
    cfg.parallel.sequence_parallel = True
    rank = AsyncPipelineRank(cfg, VOCAB, "pipeoptim", 1, 1, "adam", {"lr": LR["adam"], "weight_decay": 0.01},
                             lr_fn_for("adam"), 0.0)
    losses = rank.train_segment(get_batch, 6)
    return losses, rank.full_state_dict()


def both_runs():
    return distributed_async(FULL), distributed_async(SELECTIVE), distributed_async(NONE)


def test_tp2_pp2_pipeoptim_recompute_bitwise():
    results = run_distributed(both_runs, 4, tp=2, pp=2)
    for rank, (full, selective, none) in enumerate(results):
        assert_same(full, none, f"rank {rank} full")
        assert_same(selective, none, f"rank {rank} selective")
    assert any(r[2][0] is not None for r in results)  # the last stage returned losses


def test_recompute_needs_a_graph_only():
    """No graph (evaluation, decoding): plain forward, same outputs."""
    cfg = with_recompute(make_cfg(2), FULL)
    model = GPTModel(cfg.model, VOCAB, SEED).eval()
    plain = GPTModel(make_cfg(2).model, VOCAB, SEED).eval()
    b = get_batch(0)
    with torch.no_grad():
        assert torch.equal(model(input_ids=b["tokens"]), plain(input_ids=b["tokens"]))


# ---- end to end through pretrain_gpt.py's entry ---------------------------------------------------------------

@pytest.mark.parametrize("method", ["1f1b", "pipeoptim"])
def test_pretrain_with_recompute_logs_the_same_losses(corpus, tmp_path, method):
    """PP=2 with dropout, through P2P and the training loop: --recompute-granularity full gives the very
    losses of the plain run."""
    from test_pretrain_gpt import ASYNC as ASYNC_FLAGS, run_layout
    flags = dict(ASYNC_FLAGS, **{"--pipeline-method": method, "--log-interval": 1, "--train-iters": 6,
                                 "--eval-interval": 6, "--hidden-dropout": 0.1, "--attention-dropout": 0.1})
    plain = run_layout(corpus, tmp_path, "plain", 2, **flags)
    full = run_layout(corpus, tmp_path, "full", 2, **flags, **{"--recompute-granularity": "full",
                                                                "--recompute-method": "uniform",
                                                                "--recompute-num-layers": 1})
    losses = [r["lm_loss"] for r in plain if "lm_loss" in r]
    assert len(losses) == 6
    assert [r["lm_loss"] for r in full if "lm_loss" in r] == losses
    assert [r["val_loss"] for r in full if "val_loss" in r] == [r["val_loss"] for r in plain if "val_loss" in r]


# ---- the bench's measurement ---------------------------------------------------------------------------------

def test_bench_tracker_counts_what_the_graph_keeps():
    """bench/memory/memory.py --recompute's LiveTensors: storages created inside and still alive, views once."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "memory", "memory.py")
    spec = importlib.util.spec_from_file_location("bench_memory", path)
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)
    x = torch.randn(1000, requires_grad=True)  # made before: not counted
    tracker = memory.LiveTensors()
    with tracker:
        a = x * 2  # kept: sin saves its input
        y = a.sin()
        view = y[:10]  # same storage as y: counted once  # noqa: F841
        tmp = torch.ones(1000)
        del tmp, a  # a stays alive in the graph (saved by sin); tmp is freed
    assert tracker.live == 2 * 4000
    assert tracker.peak == 3 * 4000
    del y, view
    assert tracker.live == 0  # the graph died with y: nothing kept


# ---- NMT: selective recomputation of every attention core (encoder, decoder, cross-attention) -----------------

def nmt_run(recompute, variant):
    from test_nmt_model import SEED as NMT_SEED, VARIANTS, batches, make_cfg as nmt_cfg

    from megatron_po.models.nmt import NMTModel
    model_parallel_seed(NMT_SEED)
    cfg = nmt_cfg(variant, **recompute)
    cfg.model = dataclasses.replace(cfg.model, hidden_dropout=0.1, attention_dropout=0.1)
    model = NMTModel(cfg.model, cfg.nmt, *VARIANTS[variant]["vocab"], NMT_SEED)
    losses = []
    for b in batches(VARIANTS[variant]["vocab"]):
        loss = masked_mean_loss(model(b), b["loss_mask"])
        loss.backward()
        losses.append(loss.detach())
    return losses, {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("variant", ["shared", "separate"])
def test_nmt_selective_bitwise(monkeypatch, variant):
    from megatron_po.models.nmt import CrossAttention
    calls, _, counted = count_calls(SelfAttention, "core_attention")
    monkeypatch.setattr(SelfAttention, "core_attention", counted)
    cross_calls, _, cross_counted = count_calls(CrossAttention, "core_attention")
    monkeypatch.setattr(CrossAttention, "core_attention", cross_counted)
    recomputed = nmt_run(SELECTIVE, variant)
    assert len(calls) == 2 * 4 * 4  # 4 self-attention layers (2 encoder, 2 decoder), 4 batches, twice each
    assert len(cross_calls) == 2 * 2 * 4  # 2 decoder layers' cross-attention
    assert_same(recomputed, nmt_run(NONE, variant), f"nmt {variant}")
