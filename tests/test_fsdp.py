"""FSDP2 (--use-torch-fsdp2, distributed/fsdp.py) against DDP and the emulator.

Synchronous layouts, one 4-rank launch (the process groups rebuilt per layout): each layout's FSDP2 run equals
its DDP run on the same global batch, 2 iterations of momentum SGD with gradient clipping active (the norm over
the shards must count every element once), fp32: per-iteration losses and grad norms within 1e-6 and every
final weight within 1e-6 (measured: losses equal, weights within 3.7e-9). Not bitwise: FSDP2 reduce-scatters every micro-batch's
gradients and sums the sharded results, DDP sums the micro-batches locally and reduces once, and the norms
add their squares in other groupings. Layouts: DP 4 (chunked output loss), TP 2 x FSDP 2 (sequence parallel),
PP 2 x FSDP 2 under 1F1B (full recomputation), interleaved 1F1B and ZB-V (whose W ops must reduce-scatter the
deferred weight gradients: counted), CP 2 x FSDP 2, EP 2 x FSDP (MoE: experts sharded over their expert-DP
pair, the dense layers over DP 4); and bf16 at DP 4 against DDP's bf16 within 2e-3 (measured 1.3e-4 on the losses,
4.4e-4 on the weights: FSDP2 reduces in fp32 and keeps fp32 shards, DDP here reduces bf16 gradients into bf16
weights), its shards fp32; Muon at DP 4 (each whole matrix assembled by its owner rank from the shards' rows for
Newton-Schulz, fp32 matmuls) within 1e-4 (measured 2.4e-5 on the weights, 4.8e-7 on the losses at lr 0.1:
Newton-Schulz amplifies the reduction-order rounding of the gradients; orthogonalising each rank's rows alone
would move the weights by ~lr); FP8 (torchao, emulated on the CPU) at DP 4 within 5e-4 (measured 1.0e-4 on the
second grad norm, 1.1e-5 on the weights, 2.4e-6 on the losses: tensorwise scales follow the values' rounding).
In every layout --log-params-norm (the shards' squares summed over the ranks they
are sharded over) within 1e-5 relative, --log-num-zeros-in-grad within 8 elements (a gradient that cancels to
exactly 0 in one reduction order need not in another: up to 4 apart measured, of 2-6; fp32 gradients only).

Asynchronous methods (`AsyncPipelineRank` with FSDP2, against `AsyncEmulator`, test_async_pipeline.py's
settings: two segments, an evaluation between them):
- PP 2 x FSDP over DP 1 (sharding over one rank: the FSDP2 code path, hooks, shards and the policies acting on
  them) equals the emulator bit for bit for every asynchronous method (async-naive, PipeDream, 2BW, SpecTrain,
  PipeOptim, PipeNAG, PipeOptim with error feedback), also at k = 2, interleaved and with clipping active
  (FSDPOptimizer adds the norm's squares in the model's order, as the emulator's plain step does);
- PP 2 x FSDP 2 equals PP 2 x DDP 2 bit for bit (k = 1, no clipping: a 2-rank mean is one rounding either
  way) for PipeOptim and PipeDream, and the emulator on the concatenated micro-batches within rtol 1e-6 on the
  losses and 5e-7 on the weights (DDP's reduction order, measured 1.1e-7 and 6.7e-8); PipeOptim's forwards
  gather exactly as many times as async-naive's (one all-gather per unit and pass: the prediction adds none);
  PipeOptim with Muon (whole matrices orthogonalised by their owners, optim/muon_dp.py) equals it under DDP bit
  for bit too; PipeDream's stash holds shards (a stashed version is half the chunk's elements at DP 2, all of
  them under DDP; as many versions).
  Where PP 2 x FSDP 2 is not DDP's bit for bit, and why (each pinned here, docs/fsdp.md):
  - the grad norm: each rank adds its shards' squares and the ranks' sums are added, so a parameter's squares
    are grouped by shard, not summed whole as under DDP: measured up to 1.3e-7 relative apart. It equals, bit for
    bit, that shard-by-shard sum computed from the DDP run's own gradients (`_shard_grouped_norm`);
  - with clipping active that norm scales every gradient: within 1e-6 of DDP (measured 1.2e-7 on the weights,
    the losses equal, the norms 1.3e-7 relative);
  - k >= 2: FSDP2 reduce-scatters every micro-batch's gradient and accumulates the shards, (g1a + g1b)/2 +
    (g2a + g2b)/2, where DDP accumulates the micro-batches and reduces once, ((g1a + g2a) + (g1b + g2b))/2:
    within 1e-6 (measured 1.1e-8 on the weights, 4.8e-7 on the losses). FSDP2 with its reduction held to each
    step's last backward (set_requires_gradient_sync, the whole gradient kept in between, which gives up the
    gradient sharding) equals DDP bit for bit: the summation order is the whole difference.
"""

from functools import partial

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported lazily by model init: once here, not in every forked rank)
import torch.distributed as dist
from dist_harness import run_distributed
from test_async_pipeline import EVAL, optimizer_kwargs, train_emulator
from test_async_policies import SEED, VOCAB, get_batch, lr_fn_for, make_cfg

from torch.distributed.fsdp import FSDPModule

from megatron_po import parallel_state as ps
from megatron_po.tensor_parallel import model_parallel_seed

TOL = dict(rtol=0, atol=1e-6)
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "4",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--optimizer", "sgd", "--lr", "0.1",
        "--clip-grad", "0.3", "--make-vocab-size-divisible-by", "64", "--seed", "7"]
PP2 = ["--pipeline-model-parallel-size", "2"]
LAYOUTS = {  # name: (flags, micro-batches per DP rank)
    "dp4-chunked-loss": (["--chunked-output-loss"], 2),
    "tp2-fsdp2-sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
    "pp2-fsdp2-1f1b-recompute": (PP2 + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                        "--recompute-num-layers", "1"], 4),
    "pp2-fsdp2-interleaved": (PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"], 4),
    "pp2-fsdp2-zb-v": (PP2 + ["--pipeline-method", "zb-v", "--num-layers-per-virtual-pipeline-stage", "1",
                              "--untie-embeddings-and-output-weights"], 4),
    "cp2-fsdp2": (["--context-parallel-size", "2"], 2),
    "ep2-fsdp": (["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-ffn-hidden-size", "32",
                  "--moe-router-topk", "2"], 2),
    "dp4-bf16": (["--bf16"], 2),
    "dp4-muon": (["--optimizer", "muon", "--muon-fp32-matmul-prec", "highest"], 2),
    "dp4-fp8": (["--fp8-format", "hybrid"], 2),
}


def _batch(iteration: int, mb: int, rows: int, seq: int = 16) -> dict:
    """Micro-batch `mb` of iteration `iteration`: this DP rank's rows of a global batch drawn from a seed."""
    g = torch.Generator().manual_seed(100 * iteration + mb)
    dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tokens = torch.randint(0, 100, (rows * dp, seq + 1), generator=g)[d * rows:(d + 1) * rows]
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(rows, seq)}


def _sync_run(flags: list, microbatches: int, fsdp: bool, iterations: int = 2):
    """One layout trained in this process group: (losses, grad norms, {name: this rank's weight}, W-op
    reduce-scatters, the sharded parameters' dtypes)."""
    from megatron_po.config import parse_args, virtual_pipeline_size
    from megatron_po.config_rules import validate
    from megatron_po.data.context_split import split_for_this_rank
    from megatron_po.distributed.checkpoint_format import named_parameters_global
    from megatron_po.gpt_workload import build_model_chunks
    from megatron_po.training_log import replica_metrics
    from megatron_po.training_setup import build_optimizer_for, data_parallel
    from megatron_po.training_step import train_step
    cfg = parse_args(MOCK + flags + (["--use-torch-fsdp2"] if fsdp else []))
    p, world = cfg.parallel, dist.get_world_size()
    dp = world // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size)
    cfg.training.global_batch_size = 2 * microbatches * dp
    validate(cfg, world)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                 virtual_pipeline_size(cfg) if p.num_layers_per_virtual_pipeline_stage else None,
                                 context_parallel_size=p.context_parallel_size)
    if cfg.model.num_experts is not None:
        ps.initialize_expert_parallel(p.expert_model_parallel_size, p.expert_tensor_parallel_size)
    torch.manual_seed(cfg.training.seed)
    model_parallel_seed(cfg.training.seed)
    chunks, ddp = data_parallel(cfg, build_model_chunks(cfg, 128))
    optimizer = build_optimizer_for(cfg, chunks, ddp)
    w_ops = []
    if fsdp:
        done = ddp.weight_grads_done
        ddp.weight_grads_done = lambda c: w_ops.append(c) or done(c)
    losses, norms = [], []
    for it in range(iterations):
        batches = [split_for_this_rank(_batch(it, m, 2)) for m in range(microbatches)]
        loss, norm = train_step(cfg, chunks, ddp, optimizer, batches, lr=0.1)
        losses.append(None if loss is None else float(loss))
        norms.append(norm)
    weights = {n: (w.detach().full_tensor() if fsdp else w.detach().clone()) for n, w in named_parameters_global(chunks)}
    dtypes = {str(w._local_tensor.dtype) for _, w in named_parameters_global(chunks)} if fsdp else set()
    cfg.logging.log_params_norm = cfg.logging.log_num_zeros_in_grad = True
    return losses, norms, weights, len(w_ops), dtypes, replica_metrics(cfg, ddp.params)


def _all_layouts():
    return {name: (_sync_run(flags, m, fsdp=False), _sync_run(flags, m, fsdp=True))
            for name, (flags, m) in LAYOUTS.items()}


def test_every_synchronous_layout_equals_ddp():
    for rank, out in enumerate(run_distributed(_all_layouts, 4, timeout=400)):
        for name, (ddp, fsdp) in out.items():
            tol = {"bf16": dict(rtol=0, atol=2e-3), "muon": dict(rtol=0, atol=1e-4),
                   "fp8": dict(rtol=0, atol=5e-4)}.get(name.split("-")[-1], TOL)
            assert (ddp[0][0] is None) == (fsdp[0][0] is None), name
            if ddp[0][0] is not None:
                torch.testing.assert_close(torch.tensor(fsdp[0]), torch.tensor(ddp[0]), **tol, msg=name)
            torch.testing.assert_close(torch.tensor(fsdp[1]), torch.tensor(ddp[1]), **tol, msg=name)
            assert fsdp[2].keys() == ddp[2].keys()
            for key in ddp[2]:
                torch.testing.assert_close(fsdp[2][key].float(), ddp[2][key].float(), **tol, msg=f"{name} {key}")
            assert fsdp[4] == {"torch.float32"}, name  # the shards are the fp32 main params (bf16 too)
            # --log-params-norm, --log-num-zeros-in-grad: the shards' sums over the ranks they are sharded over
            assert fsdp[5]["params_norm"] == pytest.approx(ddp[5]["params_norm"], rel=1e-5), name
            # (an element whose gradient is a sum that cancels exactly in one order may not in another)
            if "bf16" not in name:  # (DDP's bf16 gradients round more of them to 0 than FSDP2's fp32 ones)
                assert abs(fsdp[5]["num_zeros_in_grad"] - ddp[5]["num_zeros_in_grad"]) <= 8, name
            if name == "pp2-fsdp2-zb-v":  # one W op per micro-batch and chunk per iteration, each reduce-scattered
                assert fsdp[3] == 2 * 4 * 2, fsdp[3]


# ---- asynchronous methods on shards ------------------------------------------------------------------------

ASYNC_CASES = [  # method, optimizer, k, chunks per rank, options (PP 2, one layer per chunk, segments of 4 and 4)
    ("async-naive", "adam", 1, 1, {}),
    ("pipedream", "adam", 1, 1, {}),
    ("pipedream-2bw", "adam", 2, 1, {}),
    ("spectrain", "sgd", 1, 1, {}),
    ("pipeoptim", "adam", 1, 1, {}),
    ("pipenag", "nag", 1, 1, {}),
    ("pipeoptim", "nadamw", 1, 1, {"error_feedback": True}),
    # Clipping active (grad norms 0.2-2.9): the norm's last bit reaches every weight. Until FSDPOptimizer added
    # the squares in the model's order (the emulator's) rather than the param groups', these were 1 ulp off.
    ("pipedream", "sgd", 2, 1, {"clip_grad": 0.3}),
    ("pipeoptim", "adam", 2, 2, {"clip_grad": 0.3}),
]
SEGMENTS = (4, 4)
DP2_METHODS = ("pipeoptim", "pipedream")  # at PP 2 x FSDP 2, momentum SGD on micro-batches of 4 rows


def _emulate_all():
    dp1 = [train_emulator(m, o, 2, v, k, SEGMENTS, **opts) for m, o, k, v, opts in ASYNC_CASES]
    dp2 = [train_emulator(m, "sgd", 2, 1, 1, SEGMENTS, mbs=4, masked=False) for m in DP2_METHODS]
    return dp1, dp2


class _Gathers:
    """Counts FSDP2's parameter all-gathers while `on` (`dist.all_gather_single`; before torch 2.10
    `all_gather_into_tensor`)."""

    NAME = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"

    def __init__(self):
        self.count, self.on, self._real = 0, False, getattr(dist, self.NAME)
        setattr(dist, self.NAME, self)

    def __call__(self, *args, **kwargs):
        self.count += self.on
        return self._real(*args, **kwargs)

    def close(self):
        setattr(dist, self.NAME, self._real)


def _shard_grouped_norm(params) -> float:
    """The grad norm FSDP2's optimizer adds up from these whole (DP-mean) gradients: DP rank r's rows of every
    parameter (FSDP2's dim-0 cut, torch.chunk), squared and summed per rank in the model's order (float32,
    clip_grads.squared_sums), the ranks' float64 sums added (FSDPOptimizer's all-reduce over the shards)."""
    from megatron_po.distributed.ddp import grad_of
    from megatron_po.optim.clip_grads import squared_sums
    dp = ps.get_data_parallel_world_size()
    pieces = [(grad_of(p), p) for p in params if grad_of(p) is not None]
    per_rank = [squared_sums([(g.chunk(dp)[r], p) for g, p in pieces]).sum() for r in range(dp)]
    return float(sum(per_rank[1:], per_rank[0]).sqrt())


def _train_async(method, optimizer, k, fsdp, mbs=2, masked=True, v=1, clip_grad=0.0, reduce_at_step=False,
                 **options):
    """test_async_pipeline.train_distributed's run with FSDP2 or not: (losses, eval loss, weights, copies,
    gathers during training, units x passes, PipeDream's stashed versions as fractions of the chunk's weights,
    the grad norm of every step of chunk 0, and under DDP over several ranks without clipping the norm FSDP2
    would add up from the same gradients, `_shard_grouped_norm`). `reduce_at_step`: FSDP2 keeps each unit's whole
    gradient until the chunk's last backward before a step and reduce-scatters the sum then (its
    set_requires_gradient_sync, held off before), so the micro-batches are summed before the ranks, as DDP sums
    them."""
    from megatron_po.pipeline import async_stage
    from megatron_po.pipeline.async_pipeline import AsyncPipelineRank
    model_parallel_seed(SEED)
    cfg = make_cfg(2 * v)
    cfg.parallel.use_torch_fsdp2 = fsdp
    rank = AsyncPipelineRank(cfg, VOCAB, method, v, k, optimizer, optimizer_kwargs(optimizer), lr_fn_for(optimizer),
                             clip_grad, **options)
    if reduce_at_step:
        make_runner = rank.stage.runner

        def runner(*args, **kwargs):
            made = make_runner(*args, **kwargs)
            made.grad_sync = lambda c, enabled: rank.chunks[c].set_requires_gradient_sync(enabled)
            return made
        rank.stage.runner = runner
    norms, shard_grouped, step, plain_norm = [], [], rank.stage.step, async_stage.global_grad_norm

    def recorded_step(c):
        step(c)
        if c == 0:
            norms.append(rank.stage.grad_norms[0])
    rank.stage.step = recorded_step
    if not fsdp and ps.get_data_parallel_world_size() > 1:  # (restored below: the ranks run case after case)
        def plain_and_shard_grouped(params, *args):
            shard_grouped.append(_shard_grouped_norm(params))
            return plain_norm(params, *args)
        async_stage.global_grad_norm = plain_and_shard_grouped
    policy, gathers, stash_fraction = rank.stage.policy, _Gathers(), []
    if method == "pipedream":  # the elements of each stashed version, over the chunk's parameter elements
        before_step = policy.before_step

        def measured(chunk):
            before_step(chunk)
            whole = sum(p.numel() for p in rank.chunks[chunk].parameters())
            stash_fraction.extend(sum(t.numel() for t in v) / whole for v in policy.stash[chunk].values())
        policy.before_step = measured
    dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = mbs // dp

    def batch(mb):
        return {key: t[d * share:(d + 1) * share] for key, t in get_batch(mb, mbs=mbs, masked=masked).items()}

    losses = []
    for i, m in enumerate(SEGMENTS):
        gathers.on = True
        out = rank.train_segment(batch, m)
        gathers.on = False
        losses = None if out is None else losses + out
        if i == 0:
            eval_loss = rank.evaluate(EVAL)
    gathers.close()
    async_stage.global_grad_norm = plain_norm
    units = sum(isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None
                for c in rank.chunks for m in c.modules())  # units holding parameters: gathered on their own
    copies = {(rank.rank, c): n for c, n in rank.copies_per_chunk().items()}
    return (losses, eval_loss, rank.full_state_dict(), copies, gathers.count, units * 2 * sum(SEGMENTS), stash_fraction,
            norms, shard_grouped)


def _dp1_cases():
    return [_train_async(m, o, k, True, v=v, **opts) for m, o, k, v, opts in ASYNC_CASES]


def _dp2_cases():
    runs = {(m, fsdp): _train_async(m, "sgd", 1, fsdp, mbs=4, masked=False) for m in DP2_METHODS for fsdp in (0, 1)}
    runs[("async-naive", 1)] = _train_async("async-naive", "sgd", 1, True, mbs=4, masked=False)
    for fsdp in (0, 1):  # Muon: each whole matrix orthogonalised by its owner, the update's rows sent back
        runs[("muon", fsdp)] = _train_async("pipeoptim", "muon", 1, fsdp, mbs=4, masked=False)
    for mode in ("ddp", "fsdp", "reduce-at-step"):  # k = 2: two micro-batches per step
        runs[("k2", mode)] = _train_async("pipeoptim", "sgd", 2, mode != "ddp", mbs=4, masked=False,
                                          reduce_at_step=mode == "reduce-at-step")
    for fsdp in (0, 1):  # clipping active (norms 0.2-2.9)
        runs[("clip", fsdp)] = _train_async("pipeoptim", "sgd", 1, fsdp, mbs=4, masked=False, clip_grad=0.3)
    return runs


@pytest.fixture(scope="module")
def emulated():
    return run_distributed(_emulate_all, 1)[0]


def _merged(results, i):
    out = {}
    for r in results:
        out.update(r[i])
    return out


def test_every_async_method_on_shards_over_one_rank_equals_the_emulator_bitwise(emulated):
    results = run_distributed(_dp1_cases, 2, pp=2)
    for case, emu, first, last in zip(ASYNC_CASES, emulated[0], *results):
        assert last[0] == emu[0] and last[1] == emu[1], case  # every micro-batch's loss, the evaluation
        weights = _merged([first, last], 2)
        assert weights.keys() == emu[2].keys()
        assert all(torch.equal(weights[k], emu[2][k]) for k in weights), case
        assert _merged([first, last], 3) == emu[3], case  # the same weight versions (of shards) held


def test_pp2_fsdp2_equals_ddp_bitwise_and_the_emulator(emulated):
    results = run_distributed(_dp2_cases, 4, pp=2)  # ranks 0, 1: stage 0 (DP 0, 1); 2, 3: stage 1
    for method in (*DP2_METHODS, "muon"):
        ddp, fsdp = ([r[(method, f)] for r in results] for f in (0, 1))
        for a, b in zip(ddp, fsdp):
            assert a[0] == b[0] and a[1] == b[1], method  # bit for bit: losses, evaluation
            assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2]), method
            assert a[3] == b[3], method  # as many weight versions as under DDP
    for method, emu in zip(DP2_METHODS, emulated[1]):
        fsdp = [r[(method, 1)] for r in results]
        dp_mean = [(x + y) / 2 for x, y in zip(fsdp[2][0], fsdp[3][0])]  # the two DP halves of each micro-batch
        # (DDP's reduction order: measured 1.1e-7 relative on the losses, 6.7e-8 on the weights)
        torch.testing.assert_close(torch.tensor(dp_mean), torch.tensor(emu[0]), rtol=1e-6, atol=0)
        weights = _merged([fsdp[0], fsdp[2]], 2)
        for name in emu[2]:
            torch.testing.assert_close(weights[name], emu[2][name], rtol=0, atol=5e-7, msg=name)
    for r in results:
        naive, predicted = r[("async-naive", 1)], r[("pipeoptim", 1)]
        assert predicted[4] == naive[4] == predicted[5], (predicted[4], naive[4], predicted[5])  # one gather per unit and pass
        # The grad norm (no clipping) is the same gradients' squares added shard by shard, bit for bit: not DDP's
        # whole-parameter sums (up to 1.3e-7 relative apart), the one difference at k = 1.
        for method in DP2_METHODS:
            assert r[(method, 1)][7] == r[(method, 0)][8] and len(r[(method, 1)][7]) == sum(SEGMENTS), method
        # k = 2: FSDP2 reduce-scatters each micro-batch, (g1a + g1b)/2 + (g2a + g2b)/2, DDP sums the micro-batches
        # first, ((g1a + g2a) + (g1b + g2b))/2: 1.1e-8 apart on the weights, 4.8e-7 on the losses. With FSDP2's
        # reduction held to each step's last backward (the whole gradient kept meanwhile) it is DDP's, bit for bit.
        ddp, fsdp, held = (r[("k2", mode)] for mode in ("ddp", "fsdp", "reduce-at-step"))
        assert held[0] == ddp[0] and held[1] == ddp[1] and all(torch.equal(held[2][k], ddp[2][k]) for k in ddp[2])
        assert held[7] == ddp[8] and fsdp[2].keys() == ddp[2].keys()
        if ddp[0] is not None:
            torch.testing.assert_close(torch.tensor(fsdp[0]), torch.tensor(ddp[0]), **TOL)
        for key in ddp[2]:
            torch.testing.assert_close(fsdp[2][key], ddp[2][key], **TOL, msg=key)
        # Clipping active: the norm's shard-by-shard rounding scales every gradient (1.2e-7 on the weights).
        ddp, fsdp = r[("clip", 0)], r[("clip", 1)]
        assert ddp[0] is None or max(abs(a - b) for a, b in zip(fsdp[0], ddp[0])) <= 1e-6
        assert all(torch.allclose(fsdp[2][key], ddp[2][key], rtol=0, atol=1e-6) for key in ddp[2])
        assert fsdp[7] == pytest.approx(ddp[7], rel=1e-6, abs=0)
    stage0 = results[0]  # stashes one version (s = 1): the whole chunk under DDP, this rank's half under FSDP2
    assert set(stage0[("pipedream", 0)][6]) == {1.0} and set(stage0[("pipedream", 1)][6]) == {0.5}
