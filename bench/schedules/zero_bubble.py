"""Zero-bubble schedules on synthetic stages: ours vs the simulator's bound vs torch.distributed.pipelining.

    python bench/schedules/zero_bubble.py [--stages 4 --M 8 --tf 0.02 --tB 0.02 --tW 0.02 --reps 3 --warmup 1
                                 --spin-ms 0.5 --no-trim --skip-async --out bench/results/zero_bubble.md]

(bench/schedules/schedules.py runs it at the end unless `--skip-zb`.)

Every rank is a forked process in a gloo group (tests/dist_harness.py). Each virtual stage is

    y = SleepInput(x) * SleepWeight(p)        (p: a [WIDTH] parameter of ones)

`SleepInput` sleeps t_f in forward and t_B in backward (the input gradient); `SleepWeight` is the identity
on the parameter and sleeps t_W in backward (the weight gradient). The product is a native op, so an
autograd pass that only wants the input gradient (torch's `stage_backward_input`) never reaches
`SleepWeight`, and torch's W pass (`stage_backward_weight`) runs only it; our B op defers SleepWeight's
sleep to the W op the same way it defers the linear layers' weight gradients (`weight_grads.defer`).
A fused backward (1F1B) sleeps t_B + t_W. Sleeping releases the CPU, so D ranks run in parallel on 2
cores; each row's variants run alternately in the same processes.

An op should cost its nominal time, which a bare `time.sleep` does not give: it wakes ~0.2 ms late and the
autograd calls around it add ~0.1 ms, an excess a zero-bubble schedule (3 ops per micro-batch and stage)
pays 1.5x as often as 1F1B (2). So each sleep ends with a short spin (`hold`, `--spin-ms`), and the ops are
trimmed: measured in one process, each op's sleep is shortened by what the op took above its nominal time
(twice; `--no-trim` runs the untrimmed ops). Our schedules and torch's run the same ops.

Columns: `bound` = M / simulated makespan (nominal costs, t_p2p = 0), as a fraction of the ideal
1/(t_f+t_B+t_W) micro-batches/s; `bound cal` = the same with the (trimmed) ops' costs measured in one
process; `ours` and `torch` measured the same way (median makespan of --reps
after --warmup); `ours/bound`, `ours/torch`; `peak` = the most micro-batches in flight per rank (forward
run, weight gradient not yet) read off our op lists (torch's schedules: the same rules, not measured).
The async PipeOptim row is bench/schedules/schedules.py's steady-state measurement on its own sleeping stages
with t_b = t_B + t_W (no split), for reference.
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
from torch import nn  # noqa: E402

from bench_common import Lines, header, load_at_end, markdown_table  # noqa: E402
from dist_harness import run_distributed  # noqa: E402
from megatron_po import parallel_state as ps  # noqa: E402
from megatron_po.pipeline.schedules import build_schedule, check_schedule, placement_of, virtual_stage  # noqa: E402
from megatron_po.pipeline.simulator import simulate  # noqa: E402
from megatron_po.tensor_parallel import weight_grads  # noqa: E402
from schedules_measure import makespans, timed  # noqa: E402
from schedules_stages import WIDTH, run_rank_on, synthetic_specs, torch_schedule  # noqa: E402

TIMEOUT = 1800.0
SPIN_S = 0.0005  # hold(): sleep until this long before the op's end, then spin (0: a plain time.sleep)


def hold(t: float) -> None:
    """Take t seconds: time.sleep alone overshoots by ~0.2 ms here, a per-op error a zero-bubble schedule
    (3 ops per micro-batch and stage) pays 1.5x as often as 1F1B; the short spin ends the op on time."""
    end = time.perf_counter() + t
    if t > SPIN_S:
        time.sleep(t - SPIN_S)
    while time.perf_counter() < end:
        pass


class SleepInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t_f, t_b):
        hold(t_f)
        ctx.t_b = t_b
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        hold(ctx.t_b)
        return grad.clone(), None, None


class SleepWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, t_w):
        ctx.t_w, ctx.p = t_w, p
        return p.clone()

    @staticmethod
    def backward(ctx, grad):
        if weight_grads.deferring():  # our B op: the weight gradient's cost moves to the W op
            p, t_w = ctx.p, ctx.t_w
            weight_grads.defer(lambda: (hold(t_w), [(p, grad.clone())])[1])
            return None, None
        hold(ctx.t_w)
        return grad.clone(), None


class ZBSleepStage(nn.Module):
    """StageRunner's interface (pre_process / post_process, forward(input_ids, hidden_states, labels))."""

    def __init__(self, t_f, t_b, t_w, pre_process, post_process):
        super().__init__()
        self.t_f, self.t_b, self.t_w = t_f, t_b, t_w
        self.pre_process, self.post_process = pre_process, post_process
        self.p = nn.Parameter(torch.ones(WIDTH))

    def compute(self, x):
        return SleepInput.apply(x, self.t_f, self.t_b) * SleepWeight.apply(self.p, self.t_w)

    def forward(self, input_ids=None, hidden_states=None, labels=None, loss_mask=None):
        return self.compute(input_ids if self.pre_process else hidden_states)


class TorchZBSleepStage(ZBSleepStage):
    def forward(self, x):
        return self.compute(x)


def chunks_of(rank, D, v, t_f, t_b, t_w, cls=ZBSleepStage, placement="interleaved"):
    last = D * v - 1
    vss = [virtual_stage(rank, c, D, placement) for c in range(v)]
    return [cls(t_f / v, t_b / v, t_w / v, vs == 0, vs == last) for vs in vss]


def run_variants(method, torch_kind, v, M, t_f, t_b, t_w, mbs, warmup, reps):
    """Ours (run_rank + StageRunner + P2PTransport with agreed shapes) and torch's `torch_kind` on
    identical stages, alternating. Returns {"ours": [(start, end)], "torch": [...]}."""
    D, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    placement = placement_of(method)
    ours = run_rank_on(method, chunks_of(r, D, v, t_f, t_b, t_w, placement=placement), mbs, synthetic_specs(mbs))
    run_torch = None if torch_kind is None else torch_schedule(
        torch_kind, chunks_of(r, D, v, t_f, t_b, t_w, TorchZBSleepStage, placement), M, mbs, placement)
    out = {"ours": [], "torch": []}
    for _ in range(warmup + reps):
        out["ours"].append(timed(lambda: ours(M)))
        if run_torch is not None:
            out["torch"].append(timed(run_torch))
    return out


def calibrate(t_f, t_b, t_w, n=20):
    """Median measured duration (s) of one stage's F, B and W ops in one process, no p2p: the sleeps'
    overshoot and the autograd calls included. A fused backward costs B + W."""
    stage = ZBSleepStage(t_f, t_b, t_w, True, False)
    x = torch.randn(4, WIDTH, requires_grad=True)  # an inner stage: B reaches its input
    f, b, w = [], [], []
    for _ in range(n + 2):
        t0 = time.perf_counter()
        y = stage(input_ids=x)
        t1 = time.perf_counter()
        with weight_grads.defer_weight_grads() as queue:
            torch.autograd.backward([y], [torch.ones_like(y)])
        t2 = time.perf_counter()
        weight_grads.apply_weight_grads(queue)
        t3 = time.perf_counter()
        f.append(t1 - t0), b.append(t2 - t1), w.append(t3 - t2)
    return tuple(statistics.median(x[2:]) for x in (f, b, w))


def trimmed_op_costs(nominal, trim=True, chunk_counts=(1, 2)):
    """({v: measured F/B/W op costs per chunk}, {v: per-stage sleeps to run}, {v: their measured op costs}).

    Trimmed: each op sleeps its nominal time less what the op measured above it (autograd, the sleep's
    wake-up), twice (the second pass corrects the first's measurement noise), so an op costs its nominal
    time and a simulation at nominal costs is the bound of the ops that really run."""
    op_costs = lambda v, stage_costs: run_distributed(calibrate, 1, args=tuple(c / v for c in stage_costs))[0]  # noqa: E731
    untrimmed = {v: op_costs(v, nominal) for v in chunk_counts}
    run_costs, cal = {v: tuple(nominal) for v in chunk_counts}, dict(untrimmed)
    for _ in range(2 if trim else 0):
        run_costs = {v: tuple(max(0.0, r + c - v * m) for r, c, m in zip(run_costs[v], nominal, cal[v]))
                     for v in chunk_counts}
        cal = {v: op_costs(v, run_costs[v]) for v in chunk_counts}
    return untrimmed, run_costs, cal


ROWS = [  # (label, our method, v, torch schedule)
    ("1f1b", "1f1b", 1, "1f1b"),
    ("interleaved 1f1b v=2", "1f1b", 2, "interleaved"),
    ("zb-h1", "zb-h1", 1, "zb"),
    ("interleaved zb-h1 v=2", "zb-h1", 2, "zb"),
    ("zb-h2", "zb-h2", 1, None),
    ("zb-v (2 chunks, V)", "zb-v", 2, "zbv"),
]


def run_zero_bubble(D=4, M=8, t_f=0.02, t_b=0.02, t_w=0.02, mbs=4, warmup=1, reps=3, with_async=True,
                    out_path=None, command=None, trim=True):
    started = time.perf_counter()
    out = Lines(header(__file__, sys.argv[1:], command=command))
    emit = out.emit
    emit(f"Synthetic sleeping stages (see the docstring of bench/schedules/zero_bubble.py): D={D}, M={M}, per stage t_f="
         f"{t_f * 1e3:g} ms, t_B={t_b * 1e3:g} ms, t_W={t_w * 1e3:g} ms (v=2: each chunk at half), [{mbs}, {WIDTH}] "
         f"activations; median of {reps} after {warmup} warm-up. Fractions are of the ideal "
         f"1/(t_f+t_B+t_W) = {1 / (t_f + t_b + t_w):.2f} micro-batches/s. torch: Schedule1F1B, "
         f"ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble (v=1: ZB-H1; v=2: interleaved ZB1P), "
         f"ScheduleZBVZeroBubble (ZB-V).")
    emit()
    ideal = 1.0 / (t_f + t_b + t_w)
    nominal = (t_f, t_b, t_w)
    untrimmed, run_costs, cal = trimmed_op_costs(nominal, trim)
    ms = lambda xs: " / ".join(f"{x * 1e3:.2f}" for x in xs)  # noqa: E731
    emit(f"Op costs measured in one process (no p2p; the sleep's wake-up and autograd included), F / B / W: "
         f"{ms(untrimmed[1])} ms per stage, {ms(untrimmed[2])} ms per v=2 chunk for ops that sleep their nominal "
         f"time (each synthetic op sleeps until {SPIN_S * 1e3:g} ms before its end, then spins)"
         + (f"; trimmed by that excess, {ms(cal[1])} and {ms(cal[2])} ms: the runs below use the trimmed ops, so "
            "the nominal `bound` is the bound of what runs." if trim else
            ". `--no-trim`: the runs below use these ops as they are.")
         + " `bound cal`: the simulator with these measured costs. A zero-bubble iteration has 3 ops per "
           "micro-batch and stage where 1F1B has 2, so an excess per op costs it more.")
    emit()
    rows, summary = [], {}
    for label, method, v, kind in ROWS:
        schedule = build_schedule(method, D, v, M)
        peak = check_schedule(schedule).peak_activations
        tl = simulate(schedule, t_f / v, t_b / v, t_weight=t_w / v)
        bound = M / tl.makespan
        bound_cal = M / simulate(schedule, *cal[v][:2], t_weight=cal[v][2]).makespan
        per_rank = run_distributed(run_variants, D, pp=D, timeout=TIMEOUT,
                                   args=(method, kind, v, M, *run_costs[v], mbs, warmup, reps))
        ours = M / statistics.median(makespans([r["ours"] for r in per_rank], warmup))
        theirs = M / statistics.median(makespans([r["torch"] for r in per_rank], warmup)) if kind else None
        # judged against the lower of the two bounds' fractions: the trim is measured, so not exact
        summary[label] = (min(ours / bound, ours / bound_cal), None if theirs is None else ours / theirs)
        rows.append([label, f"{bound / ideal:.3f}", f"{bound_cal / ideal:.3f}", f"{ours / ideal:.3f}",
                     f"{ours / bound:.3f}", f"{ours / bound_cal:.3f}",
                     "-" if theirs is None else f"{theirs / ideal:.3f}",
                     "-" if theirs is None else f"{ours / theirs:.3f}x",
                     " / ".join(str(peak[r]) for r in range(D))])
        print("  ", rows[-1], f"[{time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.2f}]", flush=True)
    if with_async:
        from schedules_runs import synthetic_async  # bench/schedules/schedules.py's async measurement
        per_rank = run_distributed(synthetic_async, D, pp=D, timeout=TIMEOUT,
                                   args=(M, t_f, t_b + t_w, mbs, warmup, reps))
        got = statistics.median(per_rank[-1][0]["pipeoptim"])
        rows.append([f"async PipeOptim k=1 (steady state, fused backward {(t_b + t_w) * 1e3:g} ms)", "1.000", "-",
                     f"{got / ideal:.3f}", f"{got / ideal:.3f}", "-", "-", "-", " / ".join(str(D - r) for r in range(D))])
        print("  ", rows[-1], flush=True)
    emit(markdown_table(["schedule", "bound", "bound cal", "ours", "ours/bound", "ours/bound cal", "torch", "ours/torch",
                         "peak in flight per rank"], rows))
    emit()
    if "zb-h1" in summary and "interleaved 1f1b v=2" in summary:
        met = lambda ok: "met" if ok else "not met"  # noqa: E731
        frac, vs_torch = summary["zb-h1"]
        inter = summary["interleaved 1f1b v=2"][0]
        emit(f"Targets (issue 19; a fraction of the bound is the lower of ours/bound and ours/bound cal): ZB-H1 >= "
             f"0.97 of its bound: {frac:.3f} ({met(frac >= 0.97)}); >= 1.0x torch's zero-bubble schedule: "
             f"{vs_torch:.3f}x ({met(vs_torch >= 1.0)}); interleaved 1F1B >= 0.97 of its bound: {inter:.3f} "
             f"({met(inter >= 0.97)}).")
        emit()
    emit(load_at_end(started))
    if out_path:
        out.write(out_path)
        print(f"\nwritten to {out_path}")
    return summary


def add_stage_arguments(p, stages: int, reps: int) -> None:
    """The sleeping stages' flags, shared by this script and bench/schedules/simulator_check.py: D, the op times,
    the micro-batch size, repetitions and warm-up, and the trim."""
    p.add_argument("--stages", type=int, default=stages)
    p.add_argument("--tf", type=float, default=0.02, help="forward time per stage (s)")
    p.add_argument("--tB", type=float, default=0.02, help="input-gradient backward time per stage (s)")
    p.add_argument("--tW", type=float, default=0.02, help="weight-gradient backward time per stage (s)")
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--reps", type=int, default=reps)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-trim", action="store_true",
                   help="ops sleep their nominal time as it is (default: less the excess measured in one process)")


def main():
    p = bench_common.parser(__doc__)
    add_stage_arguments(p, stages=4, reps=3)
    p.add_argument("--M", type=int, default=8)
    p.add_argument("--skip-async", action="store_true")
    p.add_argument("--spin-ms", type=float, default=SPIN_S * 1e3,
                   help="each synthetic op sleeps until this long before its end, then spins (0: time.sleep only)")
    p.add_argument("--out", default=os.path.join(bench_common.RESULTS, "zero_bubble.md"))
    a = p.parse_args()
    globals()["SPIN_S"] = a.spin_ms / 1e3  # the ranks are forked after this: they inherit it
    run_zero_bubble(a.stages, a.M, a.tf, a.tB, a.tW, a.mbs, a.warmup, a.reps, not a.skip_async, a.out,
                    trim=not a.no_trim)


if __name__ == "__main__":
    main()
