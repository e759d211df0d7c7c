"""Communication of asynchronous pipelines under data parallelism (issue: async comms overlap).

    python bench/schedules/async_comms.py [--reps 5 --n 32 --layers 4 --bulk 2000000 --t-f 0.02]

Three tables, every variant of a table alternating in the same forked gloo processes (tests/dist_harness.py,
one torch thread per rank), written to bench/results/async_comms.md with the command, the settings and
the load average (this box is shared: read ratios, not absolute numbers):

1. Tiny GPT, PP=2 x DP=2, PipeOptim (AdamW, k = 1): tokens/s of `AsyncPipelineRank.train_segment` over
   n micro-batches with the plain optimizer (DP all-reduce of bucketed gradients from the backward) and the
   distributed optimizer (one packed all-gather per micro-batch: updated + predicted shards; restore a
   pointer swap; on gloo the gradients all-reduced, found-inf and norm taken locally), also with
   --overlap-param-gather; and, as a bound, plain plus one 8-byte DP all-reduce per step. (The distributed
   optimizer before issue 17, three gathers a micro-batch, and with the reduce-scatter on gloo, were rows
   until commit 286484f: bench/results/async_comms.md.) Next to it the CPU time per micro-batch and rank,
   how many cores the ranks kept busy, and the parameter all-gather calls and bytes per micro-batch of
   stage 0 (s = 1) and stage 1 (s = 0).
2. Synthetic stages with a real gradient volume (a sleeping stage, t_b = 2 t_f, plus a `--bulk`-element
   fp32 gradient in 4 parameters, which the step must average over DP): PipeOptim micro-batches/s per pipeline
   at DP=1 (PP=2, 2 processes) and DP=2 (PP=2 x DP=2, 4 processes), with the reduce issued from the
   backward hooks and with no reduce at all (a bound: the cost of the extra processes alone; the reduce at
   the step, before issue 17, was a row until commit 286484f); CPU time per micro-batch and rank
   and the cores the ranks kept busy next to it.
3. The collectives on 2 ranks (all-reduce, reduce-scatter, all-gather), median ms per size.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from dist_harness import run_distributed  # noqa: E402
from megatron_po import parallel_state as ps  # noqa: E402
from megatron_po.config import ModelConfig  # noqa: E402
from megatron_po.distributed import ddp as ddp_module  # noqa: E402
from megatron_po.pipeline.async_pipeline import AsyncPipelineRank  # noqa: E402
from megatron_po.pipeline.partition import ActivationSpecs, gpt_message_specs  # noqa: E402
from megatron_po.tensor_parallel import model_parallel_seed  # noqa: E402
from bench_common import median  # noqa: E402
from schedules_measure import makespans, timed  # noqa: E402
from schedules_stages import WIDTH, SleepStage, gpt_config, synthetic_batches  # noqa: E402

TIMEOUT = 1800.0
GPT_VARIANTS = ("plain", "plain+1-collective", "distopt", "distopt-overlap")


def _makespans(results, variants):
    """Per variant: the median over repetitions of max(end) - min(start) over ranks."""
    return {v: median(makespans([r[v] for r in results], 0)) for v in variants}


# --------------------------------------------------------------------------------------------------
# 1. Tiny GPT, PP=2 x DP=2
# --------------------------------------------------------------------------------------------------


def _one_more_collective(rank: AsyncPipelineRank) -> None:
    """The plain optimizer plus one 8-byte all-reduce over DP after each step, where a sharded optimizer
    must gather the updated weights before the next forward (k = 1): no data to speak of, only one more DP
    collective per micro-batch than plain. Not a training setting: a bound on any design that needs one."""
    stage, step = rank.stage, rank.stage.step
    flag = torch.zeros(2)

    def step_then_collective(c):
        step(c)
        dist.all_reduce(flag, group=ps.get_data_parallel_group())
    stage.step = step_then_collective


def gpt_dp_bench(model_cfg, vocab, mbs, n, warmup, reps, bucket_size):
    """Returns ({variant: [(start, end)]}, {variant: (gather calls, bytes) per micro-batch}, pp rank,
    buckets per stage)."""
    cfg = gpt_config(model_cfg)
    cfg.parallel.ddp_bucket_size = bucket_size
    specs = gpt_message_specs(cfg, mbs // ps.get_data_parallel_world_size())
    pool = bench_common.gpt_batches(8, mbs // ps.get_data_parallel_world_size(), model_cfg.seq_length, vocab)
    get_batch = lambda mb: pool[mb % len(pool)]  # noqa: E731
    ranks = {}
    for v in GPT_VARIANTS:
        cfg.precision.use_distributed_optimizer = v.startswith("distopt")
        cfg.precision.overlap_param_gather = v == "distopt-overlap"
        model_parallel_seed(1234)
        ranks[v] = AsyncPipelineRank(cfg, vocab, "pipeoptim", update_interval=1, message_specs=specs)
        if v == "plain+1-collective":
            _one_more_collective(ranks[v])
    gather, counted = ddp_module.all_gather_single, []

    def counting(output, input_, group, async_op):
        counted.append(output.numel() * output.element_size())
        return gather(output, input_, group, async_op)
    ddp_module.all_gather_single = counting
    spans = {v: [] for v in GPT_VARIANTS}
    comm, cpu = {}, {v: [] for v in GPT_VARIANTS}
    try:
        for i in range(warmup + reps):
            for v in (GPT_VARIANTS if i % 2 == 0 else GPT_VARIANTS[::-1]):
                counted.clear()
                cpu0 = time.process_time()  # this rank's process, its gloo threads included
                spans[v].append(timed(lambda: ranks[v].train_segment(get_batch, n)))
                if i >= warmup:  # steady: the optimizer has state from the first segment on
                    cpu[v].append((time.process_time() - cpu0) / n)
                    comm[v] = (len(counted) / len(ranks[v].stage.ddps[0].buckets) / n if ranks[v].stage.ddps
                               else 0.0, sum(counted) / n)
    finally:
        ddp_module.all_gather_single = gather
    return (spans, comm, ps.get_pipeline_model_parallel_rank(), len(ranks["plain"].stage.ddps[0].buckets),
            {v: median(xs) for v, xs in cpu.items()})


# --------------------------------------------------------------------------------------------------
# 2. Synthetic stages with a real gradient volume
# --------------------------------------------------------------------------------------------------


BULK_PIECES = 4
SYNTHETIC_VARIANTS = ("overlapped", "none")


class _Bulk(torch.autograd.Function):
    """Identity on the activation; the bulk parameter's gradient is a constant (a real gradient volume
    for the DP reduce, no compute to speak of)."""

    @staticmethod
    def forward(ctx, x, bulk):
        ctx.shape = bulk.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.shape, 1e-3)


class BulkSleepStage(SleepStage):
    """The gradient volume comes as BULK_PIECES parameters (a real stage has many), so the DP buckets
    fill one by one as the backward runs instead of all at its end."""

    def __init__(self, t_f, t_b, pre_process, post_process, bulk):
        super().__init__(t_f, t_b, pre_process, post_process)
        self.bulk = nn.ParameterList(nn.Parameter(torch.zeros(bulk // BULK_PIECES)) for _ in range(BULK_PIECES))

    def forward(self, input_ids=None, hidden_states=None, labels=None, loss_mask=None):
        x = super().forward(input_ids, hidden_states, labels)
        for piece in self.bulk:
            x = _Bulk.apply(x, piece)
        return x


def synthetic_dp_bench(t_f, t_b, mbs, bulk, n, warmup, reps):
    """PipeOptim on the sleeping stages with a bulk parameter; variants: reduce from the backward hooks
    ("overlapped") and none. Returns {variant: [(start, end)]}."""
    from megatron_po.config import Config

    def build(cfg, padded_vocab, rank, num_stages, num_chunks, device=None):
        return [BulkSleepStage(t_f, t_b, rank == 0, rank == num_stages - 1, bulk)]
    variants = SYNTHETIC_VARIANTS
    ranks = {}
    for v in variants:
        cfg = Config()
        cfg.model.untie_embeddings_and_output_weights = True
        cfg.parallel.ddp_bucket_size = bulk // 4  # several buckets
        model_parallel_seed(1234)
        ranks[v] = AsyncPipelineRank(cfg, 16, "pipeoptim", update_interval=1, optimizer_name="adam",
                                     optimizer_kwargs={"lr": 1e-4}, message_specs=ActivationSpecs((mbs, WIDTH)),
                                     build_chunks=build)
        stage = ranks[v].stage
        if v == "none" and stage.ddps is not None:  # each replica steps on its own gradient: a bound, not training
            stage._grad_sync = lambda c, enabled, s=stage: setattr(s.ddps[c], "sync_enabled", False)
            for ddp in stage.ddps:
                ddp.finish_grad_sync = lambda: None
    get_batch = synthetic_batches(mbs)
    spans, cpu = {v: [] for v in variants}, {v: [] for v in variants}
    for i in range(warmup + reps):
        for v in (variants if i % 2 == 0 else variants[::-1]):
            cpu0 = time.process_time()
            spans[v].append(timed(lambda: ranks[v].train_segment(get_batch, n)))
            cpu[v].append((time.process_time() - cpu0) / n)
    for v in variants:
        spans[v] = spans[v][warmup:]
        spans[v + "/cpu"] = median(cpu[v][warmup:])  # CPU s per micro-batch of this rank
    return spans


# --------------------------------------------------------------------------------------------------
# 3. The collectives themselves, 2 ranks
# --------------------------------------------------------------------------------------------------

COLLECTIVE_SIZES = (30_000, 120_000, 500_000, 2_000_000)  # fp32 elements: 0.12 to 8 MB


def collectives_bench(reps):
    """Median ms of one blocking all-reduce, reduce-scatter and all-gather (the distributed optimizer's
    collectives) per size, the ranks aligned by a barrier before each call, all kinds alternating."""
    world, out = dist.get_world_size(), {}
    for n in COLLECTIVE_SIZES:
        full, shard = torch.randn(n), torch.empty(n // world)
        calls = {"all-reduce": lambda: dist.all_reduce(full),
                 "reduce-scatter": lambda: ddp_module.reduce_scatter_single(shard, full, None, False),
                 "all-gather": lambda: ddp_module.all_gather_single(full, shard, None, False)}
        times = {k: [] for k in calls}
        for _ in range(reps):
            for k, call in calls.items():
                dist.barrier()
                start = time.perf_counter()
                call()
                times[k].append(time.perf_counter() - start)
        out[n] = {k: 1e3 * median(ts) for k, ts in times.items()}
    return out


# --------------------------------------------------------------------------------------------------


def main():
    p = bench_common.parser(__doc__)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--n", type=int, default=32, help="micro-batches per segment")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--mbs", type=int, default=4, help="micro-batch size (split over DP)")
    p.add_argument("--bucket-size", type=int, default=40_000_000,
                   help="tiny GPT: DDP bucket size in elements, every variant (default Megatron's 40 M: one bucket "
                        "per stage here; 30000 gives 4, which on gloo/CPU made every variant slower, plain too)")
    p.add_argument("--bulk", type=int, default=2_000_000, help="synthetic stages: gradient elements per stage")
    p.add_argument("--t-f", type=float, default=0.02, help="synthetic stages: forward seconds (backward 2x)")
    p.add_argument("--skip-gpt", action="store_true")
    p.add_argument("--skip-synthetic", action="store_true")
    p.add_argument("--skip-collectives", action="store_true")
    p.add_argument("--out", default=os.path.join(bench_common.RESULTS, "async_comms.md"))
    args = p.parse_args()
    started = time.perf_counter()
    out = bench_common.Lines(bench_common.header(__file__, sys.argv[1:], "Asynchronous pipelines under data "
                                                 "parallelism: communication (gloo, one thread per rank)"))
    emit = out.emit
    if not args.skip_gpt:
        mc = ModelConfig(num_layers=args.layers, hidden_size=64, num_attention_heads=4, seq_length=64,
                         max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                         untie_embeddings_and_output_weights=True)
        vocab = 256
        res = run_distributed(gpt_dp_bench, 4, pp=2, timeout=TIMEOUT,
                              args=(mc, vocab, args.mbs, args.n, args.warmup, args.reps, args.bucket_size))
        spans = [{v: r[0][v][args.warmup:] for v in GPT_VARIANTS} for r in res]
        buckets = {r[2]: r[3] for r in res}
        span = _makespans(spans, GPT_VARIANTS)
        tokens = args.n * args.mbs * mc.seq_length
        stage0 = next(r[1] for r in res if r[2] == 0)
        stage1 = next(r[1] for r in res if r[2] == 1)
        emit(f"## 1. Tiny GPT ({args.layers} layers, hidden 64, seq 64), PP=2 x DP=2, PipeOptim AdamW k=1, "
             f"{args.n} micro-batches of {args.mbs} per segment, median of {args.reps}; DDP buckets of "
             f"{args.bucket_size} elements ({buckets[0]} on stage 0, {buckets[1]} on stage 1; `--overlap-param-gather` "
             "waits per bucket in each module's forward pre-hook)")
        emit()
        emit("| variant | tokens/s | vs plain | CPU ms / mb per rank | cores busy | stage 0 gathers / mb "
             "| stage 0 bytes / mb | stage 1 gathers / mb | stage 1 bytes / mb |")
        emit("|---|---|---|---|---|---|---|---|---|")
        for v in GPT_VARIANTS:
            cpu = [r[4][v] for r in res]
            busy = sum(cpu) / (span[v] / args.n)  # cores' worth of CPU the 4 ranks used over the run
            emit(f"| {v} | {tokens / span[v]:.0f} | {span['plain'] / span[v]:.3f} | "
                 f"{1e3 * statistics.mean(cpu):.2f} | {busy:.2f} of {os.cpu_count()} | {stage0[v][0]:.2f} | "
                 f"{stage0[v][1]:.0f} | {stage1[v][0]:.2f} | {stage1[v][1]:.0f} |")
        emit()
        emit("`plain+1-collective` is the plain optimizer plus one 8-byte DP all-reduce after every step (not a "
             "training setting): a sharded optimizer at k = 1 needs at least that many more collectives than "
             "plain, because the next forward needs the weights the step just updated on other ranks, so its "
             "ratio is a bound on any such design on this machine. `cores busy`: the ranks' CPU time (their gloo "
             "threads included) over the wall time; near the core count the run is CPU-bound and every "
             "collective's CPU cost comes out of throughput, with no idle cycles for an overlap to use.")
        emit()
    if not args.skip_synthetic:
        t_f, t_b = args.t_f, 2 * args.t_f
        dp1 = run_distributed(synthetic_dp_bench, 2, pp=2, timeout=TIMEOUT,
                              args=(t_f, t_b, args.mbs, args.bulk, args.n, args.warmup, args.reps))
        dp2 = run_distributed(synthetic_dp_bench, 4, pp=2, timeout=TIMEOUT,
                              args=(t_f, t_b, args.mbs, args.bulk, args.n, args.warmup, args.reps))
        variants = SYNTHETIC_VARIANTS
        s1, s2 = _makespans(dp1, variants), _makespans(dp2, variants)
        emit(f"## 2. Synthetic stages, PP=2, t_f={t_f * 1000:.0f} ms, t_b={t_b * 1000:.0f} ms, "
             f"{args.bulk} fp32 gradient elements per stage ({args.bulk * 4 / 1e6:.0f} MB), PipeOptim Adam k=1, "
             f"{args.n} micro-batches per segment, median of {args.reps}")
        emit()
        emit("| DP reduce | DP=1 mb/s per pipeline | DP=2 mb/s per pipeline | DP=2 / DP=1 | CPU ms / mb per rank, "
             "DP=1 / DP=2 | cores busy, DP=1 / DP=2 |")
        emit("|---|---|---|---|---|---|")
        for v in variants:
            c1, c2 = [r[v + "/cpu"] for r in dp1], [r[v + "/cpu"] for r in dp2]
            emit(f"| {v} | {args.n / s1[v]:.2f} | {args.n / s2[v]:.2f} | {s1[v] / s2[v]:.3f} | "
                 f"{1e3 * statistics.mean(c1):.2f} / {1e3 * statistics.mean(c2):.2f} | "
                 f"{sum(c1) * args.n / s1[v]:.2f} / {sum(c2) * args.n / s2[v]:.2f} of {os.cpu_count()} |")
        emit()
        emit("`none`: no DP reduce at all (each replica steps on its own gradient; not training): what DP=2 costs "
             "here before any communication, 4 processes on the cores where DP=1 runs 2 (the Adam step on the "
             "bulk gradient is CPU work). Any correct run must also wait for the reduce of the bucket completed "
             "last, at the end of the backward.")
        emit()
    if not args.skip_collectives:
        times = run_distributed(collectives_bench, 2, timeout=TIMEOUT, args=(200,))[0]
        emit("## 3. gloo collectives, 2 ranks, median ms of 200 blocking calls (ranks aligned by a barrier)")
        emit()
        emit("| fp32 elements | MB | all-reduce | reduce-scatter | all-gather (of the half) |")
        emit("|---|---|---|---|---|")
        for n, t in times.items():
            emit(f"| {n} | {n * 4 / 1e6:.2f} | {t['all-reduce']:.3f} | {t['reduce-scatter']:.3f} | "
                 f"{t['all-gather']:.3f} |")
        emit()
        emit("Why the distributed optimizer all-reduces its gradients on gloo (`parallel_state.reduce_scatter_grads`): "
             "gloo's reduce-scatter is not cheaper than its all-reduce, and the all-reduced gradient needs no "
             "more collective for found-inf and the norm.")
        emit()
    if not args.skip_gpt and not args.skip_synthetic:
        met = lambda x: "met" if x >= 0.95 else "not met"  # noqa: E731
        d, bound = span["plain"] / span["distopt"], span["plain"] / span["plain+1-collective"]
        r, none = s1["overlapped"] / s2["overlapped"], s1["none"] / s2["none"]
        emit(f"Targets (issue 17): distributed optimizer >= 0.95x plain: {d:.3f} ({met(d)}; plain+1-collective "
             f"{bound:.3f}); DP=2 >= 0.95x DP=1: {r:.3f} ({met(r)}; no reduce at all {none:.3f}).")
        emit()
    emit(bench_common.load_at_end(started))
    out.write(args.out)


if __name__ == "__main__":
    main()
