"""The distributed asynchronous pipeline equals the single-process emulator.

Each case trains two segments (global micro-batch ids, p2p tags and step counts carry over), evaluates
in between, and compares per-micro-batch losses, the evaluation loss, the final weights and the weight
copies per chunk. PP only: bitwise (same ops in the same order per rank, fp32, one thread: the harness
sets torch.set_num_threads(1) in its children, and the emulator also runs inside run_distributed(fn, 1)).
DP=2 x PP=2 and TP=2 x PP=2 (sequence parallel) change reduction orders, so those compare against the
emulator at rtol 1e-5 / atol 1e-6: DP against an emulator whose micro-batch is the concatenation of
the DP ranks' micro-batches (unmasked, so the mean over DP equals the mean over the concatenation),
with and without clipping; TP with clipping always active, so the stage-local norm must count every TP
shard. These use momentum SGD: Adam amplifies reduction-order rounding in near-zero gradients beyond
1e-5 within a few steps.
"""

from functools import partial

import pytest
import torch
import torch._dynamo  # noqa: F401  (model init imports it lazily, ~1 s; once here, not in every forked rank)
from dist_harness import run_distributed
from test_async_policies import LR, SEED, VOCAB, get_batch, lr_fn_for, make_cfg

from megatron_po import parallel_state as ps
from megatron_po.pipeline.async_pipeline import AsyncEmulator, AsyncPipelineRank, segment_schedule
from megatron_po.pipeline.schedules import async_one_f_one_b, staleness
from megatron_po.tensor_parallel import model_parallel_seed

EVAL = [get_batch(i, salt=9) for i in range(2)]


def with_parallel(cfg, parallel):
    for key, value in (parallel or {}).items():
        setattr(cfg.parallel, key, value)
    return cfg


def optimizer_kwargs(optimizer, extra=None):
    """`extra`: more build_optimizer keyword arguments (Adam's state dtypes, test_precision_aware_optimizer.py)."""
    return {"lr": LR[optimizer], "weight_decay": 0.01, "sgd_momentum": 0.9, **(extra or {})}


def train_emulator(method, optimizer, D, v, k, segments, clip_grad=0.0, mbs=2, masked=True, parallel=None,
                   optimizer_options=None, **options):
    """`parallel`: ParallelConfig fields to set (an uneven split: tests/test_uneven_pipeline.py);
    `optimizer_options`: more optimizer keyword arguments (`optimizer_kwargs`)."""
    model_parallel_seed(SEED)
    emu = AsyncEmulator(with_parallel(make_cfg(D * v), parallel), VOCAB, method, D, v, k, optimizer,
                        optimizer_kwargs(optimizer, optimizer_options),
                        lr_fn_for(optimizer), clip_grad, **options)
    batch = lambda mb: get_batch(mb, mbs=mbs, masked=masked)  # noqa: E731
    losses = []
    for i, m in enumerate(segments):
        losses += emu.train_segment(batch, m)
        if i == 0:
            eval_loss = emu.evaluate(EVAL)
    return losses, eval_loss, emu.full_state_dict(), emu.copies_per_chunk()


def train_distributed(method, optimizer, v, k, segments, clip_grad=0.0, mbs=2, masked=True,
                      sequence_parallel=False, precision=None, on_rank=None, parallel=None, optimizer_options=None,
                      **options):
    """`precision`: PrecisionConfig fields to set; `on_rank(rank)` is called on the AsyncPipelineRank
    before training (to instrument it); `parallel`, `optimizer_options`: as train_emulator's."""
    model_parallel_seed(SEED)
    D = ps.get_pipeline_model_parallel_world_size()
    cfg = with_parallel(make_cfg(D * v), parallel)
    cfg.parallel.sequence_parallel = sequence_parallel
    cfg.parallel.ddp_bucket_size = 3000  # several buckets, shards cutting through parameters
    for key, value in (precision or {}).items():
        setattr(cfg.precision, key, value)
    rank = AsyncPipelineRank(cfg, VOCAB, method, v, k, optimizer, optimizer_kwargs(optimizer, optimizer_options),
                             lr_fn_for(optimizer), clip_grad, **options)
    if on_rank is not None:
        on_rank(rank)
    dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = mbs // dp

    def batch(mb):  # this DP rank's rows of the micro-batch the emulator sees whole
        return {key: t[d * share:(d + 1) * share] for key, t in get_batch(mb, mbs=mbs, masked=masked).items()}

    requested = []
    losses = []
    for i, m in enumerate(segments):
        out = rank.train_segment(lambda mb: requested.append(mb) or batch(mb), m)
        losses = None if out is None else losses + out
        if i == 0:
            eval_loss = rank.evaluate(EVAL)
    copies = {(rank.rank, c): n for c, n in rank.copies_per_chunk().items()}
    return losses, eval_loss, rank.full_state_dict(), copies, sorted(set(requested))


def merge(results):
    weights, copies = {}, {}
    for r in results:
        weights.update(r[2])
        copies.update(r[3])
    return weights, copies


CASES = [
    # method, optimizer, D, v, k, segments, options
    ("async-naive", "adam", 4, 1, 1, (8, 8), {}),
    ("pipedream", "adam", 4, 1, 1, (8, 8), {}),
    ("pipedream-2bw", "adam", 4, 1, 4, (8, 8), {}),
    ("spectrain", "sgd", 4, 1, 1, (8, 8), {}),
    ("pipeoptim", "adam", 4, 1, 1, (8, 8), {}),
    ("pipeoptim", "sgd", 4, 1, 2, (8, 8), {"s_offset": 1}),
    ("async-naive", "sgd", 2, 2, 1, (4, 6), {}),
    ("pipedream", "sgd", 2, 2, 1, (4, 6), {}),
    ("pipedream-2bw", "adam", 2, 2, 2, (4, 6), {}),
    ("spectrain", "sgd", 2, 2, 1, (4, 6), {}),
    ("pipeoptim", "adamw", 2, 2, 1, (4, 6), {"include_weight_decay": True}),
    ("pipeoptim", "muon", 4, 1, 1, (8, 8), {}),  # Muon's ΔW (its orthogonalised update) drives the prediction
    ("pipedream-2bw", "muon", 2, 2, 2, (4, 6), {}),
    ("pipenag", "nag", 4, 1, 1, (8, 8), {}),  # PipeNAG and error feedback (tests/test_delay_robust.py: rules)
    ("pipenag", "nag", 2, 2, 1, (4, 6), {}),
    ("pipedream-2bw", "adam", 4, 1, 4, (8, 8), {"error_feedback": True}),
    ("pipedream", "nadamw", 2, 2, 1, (4, 6), {"error_feedback": True}),
    ("pipeoptim", "nadamw", 3, 1, 1, (6, 6), {"error_feedback": True}),
]


@pytest.mark.parametrize("method,optimizer,D,v,k,segments,options", CASES,
                         ids=[f"{c[0]}-{c[1]}-D{c[2]}v{c[3]}k{c[4]}{'-ef' if c[6].get('error_feedback') else ''}"
                              for c in CASES])
def test_distributed_equals_emulator_bitwise(method, optimizer, D, v, k, segments, options):
    emu_losses, emu_eval, emu_weights, emu_copies = run_distributed(
        partial(train_emulator, **options), 1, args=(method, optimizer, D, v, k, segments))[0]
    results = run_distributed(partial(train_distributed, **options), D, pp=D, args=(method, optimizer, v, k, segments))
    last = results[D - 1]
    assert all(r[0] is None and r[1] is None for r in results[:D - 1])  # losses live on the last stage
    assert last[0] == emu_losses
    assert last[1] == emu_eval
    weights, copies = merge(results)
    assert weights.keys() == emu_weights.keys()
    for name in weights:
        assert torch.equal(weights[name], emu_weights[name]), name
    assert copies == emu_copies
    # every rank read exactly the global micro-batch ids of both segments (pre/post-process stages)
    assert results[0][4] == list(range(sum(segments)))


@pytest.mark.parametrize("clip_grad", [0.0, 0.05])
def test_dp2_pp2_equals_emulator_on_concatenated_microbatches(clip_grad):
    """Without clipping this needs the DP mean (a sum would double the step); with clipping always
    active (norms ~1.6) it needs the clip after the DP reduction."""
    args = ("pipeoptim", "sgd", 2, 1, 1, (4, 4))
    options = dict(clip_grad=clip_grad, mbs=4, masked=False)
    emu_losses, _, emu_weights, _ = run_distributed(partial(train_emulator, **options), 1, args=args)[0]
    results = run_distributed(partial(train_distributed, **options), 4, pp=2, args=("pipeoptim", "sgd", 1, 1, (4, 4)))
    # ranks: pp-major, then dp: 0 = (pp0, dp0), 1 = (pp0, dp1), 2 = (pp1, dp0), 3 = (pp1, dp1)
    dp_mean = [(a + b) / 2 for a, b in zip(results[2][0], results[3][0])]
    torch.testing.assert_close(torch.tensor(dp_mean), torch.tensor(emu_losses), rtol=1e-5, atol=1e-6)
    for r in (0, 2):  # the two DP replicas of each stage hold identical weights
        assert all(torch.equal(results[r][2][k], results[r + 1][2][k]) for k in results[r][2])
    weights = {**results[0][2], **results[2][2]}
    assert weights.keys() == emu_weights.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], emu_weights[name], rtol=1e-5, atol=1e-6, msg=name)


def test_tp2_pp2_sequence_parallel_equals_emulator_with_clipping():
    args = ("pipedream", "sgd", 2, 1, 1, (4, 4))
    emu_losses, emu_eval, emu_weights, _ = run_distributed(partial(train_emulator, clip_grad=0.05), 1, args=args)[0]
    results = run_distributed(partial(train_distributed, clip_grad=0.05, sequence_parallel=True), 4, tp=2, pp=2,
                              args=("pipedream", "sgd", 1, 1, (4, 4)))
    for r in (2, 3):  # both TP ranks of the last stage hold the (replicated) loss
        torch.testing.assert_close(torch.tensor(results[r][0]), torch.tensor(emu_losses), rtol=1e-5, atol=1e-6)
        assert abs(results[r][1] - emu_eval) < 1e-5
    weights = {**results[0][2], **results[2][2]}
    assert weights.keys() == emu_weights.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], emu_weights[name], rtol=1e-5, atol=1e-6, msg=name)


# --------------------------------------------------------------------------------------------------
# Distributed optimizer and fp16
# --------------------------------------------------------------------------------------------------


def _with_and_without_distributed_optimizer(method, optimizer, k):
    args = (method, optimizer, 1, k, (4, 4))
    plain = train_distributed(*args, mbs=4, masked=False)
    sharded = train_distributed(*args, mbs=4, masked=False, precision={"use_distributed_optimizer": True})
    return plain, sharded


@pytest.mark.parametrize("method,optimizer,k", [("pipeoptim", "adam", 1), ("spectrain", "sgd", 1),
                                                ("pipedream-2bw", "adam", 2), ("pipeoptim", "muon", 1)])
def test_pp2_dp2_distributed_optimizer_equals_plain_optimizer(method, optimizer, k):
    """PP=2 x DP=2: each DP rank steps (and, for PipeOptim and SpecTrain, predicts from) its shard of the
    fp32 main params and optimizer state, and the shards are all-gathered into the weights; 2BW swaps its
    older version into the replicated weights as before. Tolerance 0 (bitwise): a reduce-scatter and an
    all-reduce over two ranks both add a/2 + b/2, and the steps and predictions are per element, so only
    the sharding differs (tests/test_distributed_optimizer.py shows the same for single steps). Muon's step
    is not per element: each DP rank gathers the whole matrices' U first (tests/test_muon.py), then it is."""
    for plain, sharded in run_distributed(_with_and_without_distributed_optimizer, 4, pp=2, args=(method, optimizer, k)):
        if plain[0] is not None:  # the last stage holds the losses
            torch.testing.assert_close(torch.tensor(sharded[0]), torch.tensor(plain[0]), rtol=0, atol=0)
            assert sharded[1] == plain[1]
        assert plain[2].keys() == sharded[2].keys()
        for name in plain[2]:
            torch.testing.assert_close(sharded[2][name], plain[2][name], rtol=0, atol=0, msg=name)


FP16 = {"fp16": True, "use_distributed_optimizer": True, "initial_loss_scale": 2.0**12, "hysteresis": 1}
FP16_CONSTANT = {"fp16": True, "use_distributed_optimizer": True, "loss_scale": 2.0**12}


def _fp16_runs(inject_at):
    """fp32; fp16; and fp16 with an inf injected into DP rank 1's shard of stage 0's gradient at that
    stage's step `inject_at`, with the dynamic and with a constant loss scale. PipeOptim with momentum
    SGD: unlike Adam's, its step is proportional to the gradient, so a wrongly scaled one would show."""
    def inject(rank):
        stage, opt = rank.stage, rank.stage.optimizers[0]
        if rank.rank != 0 or ps.get_data_parallel_rank() != 1:
            return
        main_grads = opt._main_grads

        def with_inf():
            grads = main_grads()
            if stage.steps[0] == inject_at:
                grads[0][0] = float("inf")
            return grads
        opt._main_grads = with_inf

    out = {}
    for name, precision, on_rank in [("fp32", {}, None), ("fp16", FP16, None), ("inf", FP16, inject),
                                     ("inf-constant", FP16_CONSTANT, inject)]:
        stages = []

        def instrument(rank):
            stages.append(rank.stage)
            if on_rank is not None:
                on_rank(rank)
        losses, _, weights, *_ = train_distributed("pipeoptim", "sgd", 1, 1, (8, 8), mbs=4, masked=False,
                                                   precision=precision, on_rank=instrument)
        stage = stages[0]
        out[name] = (losses, weights, stage.skipped_steps, stage.steps,
                     stage.optimizers[0].get_loss_scale() if precision else None)
    return ps.get_pipeline_model_parallel_rank(), out


def test_fp16_skips_an_inf_step_stage_locally_and_recovers():
    """fp16 weights, fp32 main params sharded over DP, one dynamic loss scale per stage (hysteresis 1).

    An inf in one DP rank's shard of stage 0's gradient skips that step on both DP ranks of stage 0 (the
    found-inf is agreed over the stage's DP group) and halves stage 0's loss scale only; stage 1 steps
    every time. Training goes on, with the two stages now at different scales: gradients cross between
    them unscaled, so the run equals the same injection under a constant scale shared by both stages
    (tolerance 0: the scales are powers of two, which scale fp16 values exactly here). The clean fp16
    run stays within 0.005 of fp32's losses (fp16 weights and activations, 16 SGD steps; measured 6e-4)."""
    inject_at = 5
    for pp_rank, out in run_distributed(_fp16_runs, 4, pp=2, args=(inject_at,)):
        fp32, fp16, inf, constant = out["fp32"], out["fp16"], out["inf"], out["inf-constant"]
        assert fp16[2] == [0] and fp16[3] == [16] and fp16[4] == 2.0**12  # clean: no skips, scale kept
        assert constant[2] == inf[2] and constant[4] == 2.0**12
        if pp_rank == 0:
            assert inf[2] == [1] and inf[3] == [16] and inf[4] == 2.0**11
            assert any(not torch.equal(inf[1][n], fp16[1][n]) for n in fp16[1])  # the step was skipped
        else:
            assert inf[2] == [0] and inf[4] == 2.0**12
            assert torch.isfinite(torch.tensor(inf[0])).all()
            torch.testing.assert_close(torch.tensor(inf[0]), torch.tensor(constant[0]), rtol=0, atol=0)
            torch.testing.assert_close(torch.tensor(fp16[0]), torch.tensor(fp32[0]), rtol=0, atol=0.005)
        for n in inf[1]:
            torch.testing.assert_close(inf[1][n], constant[1][n], rtol=0, atol=0, msg=n)


def test_async_precision_flag_rules():
    from megatron_po.config import parse_args
    from megatron_po.config_rules import validate
    from megatron_po.errors import ConfigError
    base = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--pipeline-model-parallel-size",
            "2", "--pipeline-method", "pipeoptim", "--untie-embeddings-and-output-weights"]
    validate(parse_args(base + ["--fp16", "--use-distributed-optimizer"]), 4)
    validate(parse_args(base + ["--use-distributed-optimizer", "--overlap-param-gather"]), 4)  # one packed gather
    with pytest.raises(ConfigError, match="--overlap-param-gather applies to the synchronous methods, pipeoptim"):
        validate(parse_args([a if a != "pipeoptim" else "pipedream" for a in base]
                            + ["--use-distributed-optimizer", "--overlap-param-gather"]), 4)


# --------------------------------------------------------------------------------------------------
# Segments
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("D,v,k", [(4, 1, 1), (4, 1, 2), (3, 2, 1), (2, 2, 2)])
def test_drain_does_not_change_staleness_of_microbatches_in_flight(D, v, k):
    """s(j) of every micro-batch of a segment equals its s(j) in a three times longer stream: the
    drain only removes forwards that come after them."""
    M = 12
    short = staleness(async_one_f_one_b(D, v, M, k))
    long = staleness(async_one_f_one_b(D, v, 3 * M, k))
    for key, per_mb in short.items():
        assert per_mb == {mb: long[key][mb] for mb in per_mb}, key


def test_segment_schedule_uses_global_microbatch_ids():
    s = segment_schedule(2, 1, 4, 2, first_microbatch=8)
    ids = {op.microbatch for ops in s.ops.values() for op in ops if hasattr(op, "microbatch")}
    assert ids == set(range(8, 12))
    assert staleness(s)[(0, 0)] == {mb + 8: n for mb, n in staleness(async_one_f_one_b(2, 1, 4, 2))[(0, 0)].items()}


def test_emulator_accepts_a_list_of_batches():
    torch.set_num_threads(1)
    a = AsyncEmulator(make_cfg(2), VOCAB, "pipeoptim", 2, 1, 1, "adam", {"lr": 1e-2})
    b = AsyncEmulator(make_cfg(2), VOCAB, "pipeoptim", 2, 1, 1, "adam", {"lr": 1e-2})
    a.train_segment(get_batch, 4)
    b.train_segment([get_batch(i) for i in range(4)])
    assert a.train_segment(get_batch, 4) == b.train_segment([get_batch(4 + i) for i in range(4)])
    assert a.microbatches_consumed == b.microbatches_consumed == 8
