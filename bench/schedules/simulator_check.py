"""The timeline simulator checked against the executor, on synthetic sleeping stages (issue 36, rule 5).

    python bench/schedules/simulator_check.py [--stages 8 --M 2 4 8 --tf 0.02 --tB 0.02 --tW 0.02 --t-step 0.007
                                               --reps 5 --warmup 1 --out bench/results/simulator_check.md]
    python bench/schedules/simulator_check.py --quick     # D=4, M=2, one repetition, 5 ms ops
    python bench/schedules/simulator_check.py --schedules zb-v   # those rows again, merged into the file

The stages are bench/schedules/zero_bubble.py's (every rank a forked process in a gloo group; each op sleeps its
cost, then spins its last 0.5 ms; the sleeps trimmed by the excess an op measures in one process, so an
op costs its nominal time), with one change: the first stage's B sleeps too (`UniformSleepStage`). Per
schedule and M, the same op list goes to the executor (run_rank + StageRunner + P2PTransport with agreed
shapes) and to the simulator with the same per-op costs: t_F, t_B, t_W per stage (a fused backward
t_B + t_W, a v = 2 chunk half of each), and t_step for every Step op (the runs sleep t_step in their step:
Step(None) of a synchronous iteration on every rank, Step(c) every k backwards in the asynchronous stream).

- Synchronous schedules: 1F1B, interleaved 1F1B (v=2), ZB-H1, interleaved ZB-H1 (v=2), ZB-H2, ZB-V; the
  measured time per iteration (median over --reps of max end - min start over ranks, after a barrier)
  against the simulated makespan.
- The asynchronous stream: AsyncPipelineRank(PipeOptim, Adam) at update interval k = 1, 2 and M, in
  segments of 4 max(M) micro-batches; its steady-state time per micro-batch (the last stage's losses of
  the micro-batches a..b, a quarter and three quarters into the segment) against the simulator's over
  the same window of the same op list. The real Adam step (on one [16] parameter per stage) runs inside
  t_step (the step sleeps what remains); PipeOptim's prediction and restore around each forward run in
  the measured stream and are not priced: the `policy` column says what they cost, `step` what a step took.

Columns: `sim` = the simulator at the nominal costs, no message costs (the figure the check is about;
outside 3 % is flagged); `sim cal` = the simulator with the op costs measured in one process (F, B, W,
step) and the message costs measured between two ranks (bench/schedules/schedules_runs.py's p2p_costs: the send
call and the receive of a message already there on the ops that make them, the one-way latency on every
message); `sim run` = the simulator with the op costs measured inside the run itself (each op's wall time
less its waits in blocking receives, per rank, the median over repetitions), the same receive cost and
latency, and the time run_rank spends between ops posting receives ahead, on the receiving ops: what the
ops cost with D processes sharing the cores. Where `sim run` matches and `sim` does not, the ops got
slower, not the simulator wrong. A hand-off between two chunks of one rank (ZB-V's turn) is no message in
the executor, and neither pricing charges one there (issue 57).

`--schedules` runs some schedules' rows only (a change that moves their pricing, as issue 57's did ZB-V's):
they replace the file's rows of those schedules, its other rows are kept with a `run` column naming the run
each came from (commit, date; each run's command, load and one-process costs listed), and the replaced rows'
`sim cal` is re-priced at today's simulator from the costs their run printed (`sim run` cannot be: it needs
each rank's in-run costs, which the file does not keep).
"""

import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402  (puts the bench family folders and the repo on sys.path)
bench_common.add_repo_to_path()

import functools  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import zero_bubble as zb  # noqa: E402  (also puts tests/ on sys.path: dist_harness)
from bench_common import Lines, header, load_at_end, loadavg, markdown_table  # noqa: E402
from dist_harness import run_distributed  # noqa: E402
from schedules_measure import POLICY_HOOKS, accumulate, timed  # noqa: E402
from schedules_runs import AGREED, merge_p2p, p2p_costs  # noqa: E402
from schedules_stages import WIDTH, run_rank_on, sleeping_pipeoptim, synthetic_batches, synthetic_specs  # noqa: E402

from megatron_po import parallel_state as ps  # noqa: E402
from megatron_po.errors import ConfigError  # noqa: E402
from megatron_po.pipeline.schedules import (BackwardWeight, Forward, Step, build_schedule, comm_of,  # noqa: E402
                                            placement_of, rank_chunk_of)
from megatron_po.pipeline.simulator import simulate  # noqa: E402

TOLERANCE = 0.03
TIMEOUT = 1800.0
SYNC_ROWS = [(label, method, v) for label, method, v, _ in zb.ROWS]  # (label, method, chunks per rank)


# --------------------------------------------------------------------------------------------------
# What the simulator predicts
# --------------------------------------------------------------------------------------------------


def stage_costs(schedule, rank_costs, p2p):
    """Per virtual stage (t_F, t_B, t_W) lists for the simulator. rank_costs(r) = (t_F, t_B, t_W, extra) of
    rank r's ops (extra: CPU per received message beside the receive itself); an op that sends to another rank
    adds the send call and one that receives from another rank the receive of a message already there, plus
    extra (p2p = (latency, send call, receive)): the CPU a message costs its two ranks beside the latency the
    simulator adds to its arrival. A hand-off between two chunks of one rank (ZB-V's turn) is no message: the
    executor keeps it in memory, and the simulator charges it no latency either (issue 57)."""
    D, v = schedule.num_stages, schedule.num_chunks
    _, send, recv = p2p
    rank_of = [rank_chunk_of(vs, D, schedule.placement)[0] for vs in range(D * v)]
    # a message crosses the boundary vs | vs + 1 unless both sides are one rank (ZB-V's turn: kept in memory)
    message = [a != b for a, b in zip(rank_of, rank_of[1:])] + [False]
    out = ([], [], [])
    for vs, r in enumerate(rank_of):
        t_f, t_b, t_w, extra = rank_costs(r)
        from_before, to_after = vs > 0 and message[vs - 1], message[vs]
        out[0].append(t_f + (recv + extra if from_before else 0.0) + (send if to_after else 0.0))
        out[1].append(t_b + (recv + extra if to_after else 0.0) + (send if from_before else 0.0))
        out[2].append(t_w)
    return out


def same_on_every_rank(costs):
    """rank_costs for op costs (t_F, t_B, t_W) that are the same on every rank, nothing extra per message."""
    costs = tuple(costs)
    return lambda rank: (*costs, 0.0)


def sync_prediction(method, D, v, M, rank_costs, p2p=(0.0, 0.0, 0.0), t_step=0.0):
    """Simulated seconds per iteration; rank_costs as `stage_costs` takes it (per v-chunk; a fused
    backward costs t_B + t_W), p2p = (latency, send call, receive) per message."""
    schedule = build_schedule(method, D, v, M)
    t_f, t_b, t_w = stage_costs(schedule, rank_costs, p2p)
    return simulate(schedule, t_f, t_b, p2p[0], t_step, t_weight=t_w).makespan


def steady_window(N):
    """Micro-batches a and b whose loss times bound the steady-state window of a segment of N."""
    return N // 4, 3 * N // 4


def async_prediction(D, k, N, rank_costs, p2p=(0.0, 0.0, 0.0), t_step=0.0):
    """Simulated seconds per micro-batch of the async stream (v=1) between the last stage's losses of the
    window's micro-batches a and b (the end of their forward there), as the run times it."""
    schedule = build_schedule("async", D, 1, N, update_interval=k)
    t_f, t_b, t_w = stage_costs(schedule, rank_costs, p2p)
    timeline = simulate(schedule, t_f, t_b, p2p[0], t_step, t_weight=t_w)
    loss_at = {e.op.microbatch: e.end for e in timeline.events if e.rank == D - 1 and isinstance(e.op, Forward)}
    a, b = steady_window(N)
    return (loss_at[b] - loss_at[a]) / (b - a)


# --------------------------------------------------------------------------------------------------
# What the executor measures (one forked process per rank)
# --------------------------------------------------------------------------------------------------


class UniformSleepStage(zb.ZBSleepStage):
    """bench/schedules/zero_bubble.py's stage, with the first stage's input made to require a gradient: there autograd
    would skip SleepInput's backward (the batch needs no gradient), so the first virtual stage's B would
    cost nothing where the simulator prices t_B. Here every virtual stage's ops cost the same."""

    def forward(self, input_ids=None, hidden_states=None, labels=None, loss_mask=None):
        return self.compute(input_ids.detach().requires_grad_(True) if self.pre_process else hidden_states)


def sleeping_chunks(rank, D, v, stage_costs, placement="interleaved"):
    return zb.chunks_of(rank, D, v, *stage_costs, cls=UniformSleepStage, placement=placement)


# forward, backward (fused, or split: input), weight backward, step; P: posting a receive ahead (run_rank
# does it between ops, so it is in no op's wall time), counted per received message
OP_KINDS = ("F", "B", "W", "S", "P")


def instrument_transport(transport, acc):
    """Accumulate the time this rank waits in blocking receives, activations and gradients apart, and the
    time it spends posting receives ahead."""
    recv = transport.recv
    transport.prepost = accumulate(transport.prepost, acc, "prepost")

    def timed_recv(me, peer, key):
        start = time.perf_counter()
        out = recv(me, peer, key)
        acc["recv_" + key[0]] = acc.get("recv_" + key[0], 0.0) + time.perf_counter() - start
        return out

    transport.recv = timed_recv


def instrument_runner(runner, acc):
    """Accumulate the wall time of this rank's ops by kind (acc["F"], ...); the step is timed where it is made."""
    for name, kind in (("forward", "F"), ("backward", "B"), ("backward_weight", "W")):
        setattr(runner, name, accumulate(getattr(runner, name), acc, kind))
    return runner


def op_busy(acc):
    """Seconds this rank computed per op kind: the ops' wall time less the waits in their receives."""
    return {"F": acc.get("F", 0.0) - acc.get("recv_act", 0.0), "B": acc.get("B", 0.0) - acc.get("recv_grad", 0.0),
            "W": acc.get("W", 0.0), "S": acc.get("step", 0.0), "P": acc.get("prepost", 0.0)}


def op_counts(schedule, rank):
    ops = schedule.ops[rank]
    counts = dict.fromkeys(OP_KINDS, 0)
    recvs = [comm_of(op, rank, schedule.num_stages, schedule.num_chunks, schedule.placement)[0] for op in ops]
    counts["P"] = sum(recv is not None and recv[0] != rank for recv in recvs)  # the rank's own hand-offs post nothing
    for op in ops:
        counts["F" if isinstance(op, Forward) else "W" if isinstance(op, BackwardWeight)
               else "S" if isinstance(op, Step) else "B"] += 1
    return counts


def per_op(busy_per_rep, counts):
    """Seconds per op of each kind on one rank: the median over repetitions (a load spike in one does not
    move it), 0 where no such op ran."""
    return {k: statistics.median(b[k] for b in busy_per_rep) / counts[k] if counts[k] else 0.0 for k in OP_KINDS}


def in_run_costs(per_rank_per_op):
    """rank_costs (see `stage_costs`) of the ops as they ran on each rank: its F, B, W and its time posting
    receives ahead per received message."""
    return lambda rank: tuple(per_rank_per_op[rank][k] for k in ("F", "B", "W", "P"))


def mean_over_ranks(per_rank_per_op):
    return {k: statistics.mean(c[k] for c in per_rank_per_op) for k in OP_KINDS}


def sync_runs(cases, run_costs, t_step, mbs, warmup, reps):
    """{(label, M): ([(start, end)] of this rank, its seconds per op of each kind, `per_op`)}: every case
    once per repetition, the cases alternating. The chunks sleep run_costs[v] per stage; Step(None) sleeps
    t_step (the optimizer it stands for)."""
    D, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    acc, runs = {}, {}
    step_fn = accumulate(lambda c: zb.hold(t_step), acc, "step")
    for label, method, v, M in cases:
        run = run_rank_on(method, sleeping_chunks(r, D, v, run_costs[v], placement_of(method)), mbs,
                          synthetic_specs(mbs), lambda runner: instrument_runner(runner, acc), step_fn=step_fn)
        instrument_transport(run.transport, acc)
        runs[(label, M)] = (functools.partial(run, M), op_counts(build_schedule(method, D, v, M), r))
    spans = {key: [] for key in runs}
    busy = {key: [] for key in runs}  # per measured repetition: seconds per op kind
    for i in range(warmup + reps):
        for key, (run, _) in runs.items():
            acc.clear()
            spans[key].append(timed(run))
            if i >= warmup:
                busy[key].append(op_busy(acc))
    return {key: (spans[key], per_op(busy[key], counts)) for key, (_, counts) in runs.items()}


def async_runs(intervals, N, run_costs, t_step, mbs, warmup, reps):
    """The no-flush stream: for each k, AsyncPipelineRank(PipeOptim, Adam, agreed shapes) on the sleeping
    stages (a fused backward), each step the real Adam step and a sleep for the rest of t_step (trimmed, as
    the ops are: the step costs t_step unless Adam alone takes longer). Per k: the last stage's
    steady-state seconds per micro-batch per repetition (empty elsewhere), and this rank's mean wall time of
    one step and of the policy's hooks per micro-batch."""
    D = ps.get_pipeline_model_parallel_world_size()
    get_batch = synthetic_batches(mbs)
    ranks, acc = {}, {}
    for k in intervals:
        rank = sleeping_pipeoptim(lambda r, D, v: sleeping_chunks(r, D, v, run_costs[1]), mbs, k)
        adam_step = rank.stage.step

        def sleeping_step(c, adam_step=adam_step):  # Adam, then the rest of t_step: the op costs t_step
            start = time.perf_counter()
            out = adam_step(c)
            zb.hold(max(0.0, t_step - (time.perf_counter() - start)))
            return out

        acc[k] = {}
        rank.stage.step = accumulate(sleeping_step, acc[k], "step")
        for hook in POLICY_HOOKS:
            setattr(rank.stage.policy, hook, accumulate(getattr(rank.stage.policy, hook), acc[k], "policy"))
        make_runner = rank.stage.runner
        rank.stage.runner = lambda *args, make_runner=make_runner, acc=acc[k], **kw: instrument_runner(
            make_runner(*args, **kw), acc)
        instrument_transport(rank.transport, acc[k])
        ranks[k] = rank
    a, b = steady_window(N)
    per_mb = {k: [] for k in intervals}
    step_s, policy_s = {k: [] for k in intervals}, {k: [] for k in intervals}
    busy = {k: [] for k in intervals}  # per measured repetition: seconds per op kind
    for i in range(warmup + reps):
        for k in intervals:
            acc[k].clear()
            loss_times = []
            on_loss = lambda mb, loss: loss_times.append(time.perf_counter())  # noqa: E731
            timed(lambda: ranks[k].train_segment(get_batch, N, on_loss=on_loss))
            if i < warmup:
                continue
            if loss_times:
                assert len(loss_times) == N
                per_mb[k].append((loss_times[b] - loss_times[a]) / (b - a))
            step_s[k].append(acc[k].get("step", 0.0) / (N // k))
            policy_s[k].append(acc[k].get("policy", 0.0) / N)
            busy[k].append(op_busy(acc[k]))
    assert D == 1 or all(rank.stage.steps[0] > 0 for rank in ranks.values())
    me = ps.get_pipeline_model_parallel_rank()
    costs = {k: per_op(busy[k], op_counts(build_schedule("async", D, 1, N, update_interval=k), me)) for k in intervals}
    return per_mb, step_s, policy_s, costs


def step_cost(t_step, n=20):
    """Median measured duration of one sleeping step (hold), one process."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        zb.hold(t_step)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def message_costs(mbs, n=20):
    """Medians, for one [mbs, 16] fp32 message on gloo through our transport with agreed shapes, measured
    between two ranks (bench/schedules/schedules_runs.py's p2p_costs): the one-way latency with the receiver waiting
    (the simulator's t_p2p), the send call, and the wait of a receive posted ahead (run_rank does) whose
    data has arrived (the CPU a receive costs when nobody waits)."""
    merged = merge_p2p(run_distributed(p2p_costs, 2, pp=2, args=(mbs, n), timeout=TIMEOUT))
    return tuple(statistics.median(merged[f"{AGREED}: {what}"]) for what in (
        "one-way latency, receiver waiting", "send call",
        "receive posted before the send, wait after the data arrived"))


# --------------------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------------------


def ratio_cell(measured, predicted):
    ratio = f"{measured / predicted:.3f}"  # flagged as printed: the counts below read the table's cells
    return ratio + ("" if abs(float(ratio) - 1) <= TOLERANCE else " **outside 3 %**")


COLUMNS = ["schedule", "M", "k", "sim ms", "measured ms", "measured / sim", "best / sim", "measured / sim cal",
           "in-run op ms", "measured / sim run", "policy ms/mb"]
METHODS = sorted({method for _, method, _ in SYNC_ROWS}) + ["async"]


def run_check(D, Ms, t_f, t_b, t_w, t_step, mbs=4, warmup=1, reps=5, out_path=None, argv=(), trim=True,
              methods=METHODS):
    """Measure and price the rows of `methods` (all: the whole file); with fewer, and a results file at
    out_path, their rows replace that file's rows of the same schedules and the others are kept (`merged`)."""
    started = time.perf_counter()
    out = Lines(header(__file__, list(argv)))
    emit = out.emit
    nominal = (t_f, t_b, t_w)
    untrimmed, run_costs, cal = zb.trimmed_op_costs(nominal, trim)
    cal_step = step_cost(t_step)
    p2p = message_costs(mbs, 5 if reps == 1 else 20)
    p2p_run = (p2p[0], 0.0, p2p[2])  # an op's wall time in the run includes its sends
    ms = lambda xs: " / ".join(f"{x * 1e3:.3f}" for x in xs)  # noqa: E731
    N = 4 * max(Ms)
    intervals = sorted({1, 2, *Ms}) if "async" in methods else []
    settings = (f"D={D} ranks (forked processes, gloo, {os.cpu_count()} CPU cores), M in {list(Ms)}; synthetic "
                f"sleeping stages of bench/schedules/zero_bubble.py: per stage t_F = {t_f * 1e3:g} ms, t_B = {t_b * 1e3:g} ms, "
                f"t_W = {t_w * 1e3:g} ms (a fused backward {(t_b + t_w) * 1e3:g} ms; v=2: each chunk half), a step "
                f"{t_step * 1e3:g} ms per Step op, [{mbs}, {WIDTH}] activations; median of {reps} after {warmup} "
                f"warm-up.")
    emit(settings + f" Async: PipeOptim + Adam at k in {sorted({1, 2, *Ms})}, segments of {N} micro-batches, "
         f"window {steady_window(N)}.")
    emit()
    emit(f"Per-op costs measured in one process (no p2p), F / B / W: {ms(untrimmed[1])} ms per stage and "
         f"{ms(untrimmed[2])} ms per v=2 chunk for ops sleeping their nominal time"
         + (f"; the runs sleep less by that excess (trimmed), measured {ms(cal[1])} and {ms(cal[2])} ms" if trim else
            "; --no-trim: the runs sleep the nominal time")
         + f". Step: {cal_step * 1e3:.3f} ms. A message (two ranks, agreed shapes): one-way latency with the "
         f"receiver waiting {p2p[0] * 1e3:.3f} ms, send call {p2p[1] * 1e3:.3f} ms, a receive posted ahead whose "
         f"data is there {p2p[2] * 1e3:.3f} ms. `sim cal` prices the ops at these measured costs, the send call and "
         f"the receive on the ops that make them, and the latency on every message (a hand-off between two chunks "
         f"of one rank, ZB-V's turn, is none); `sim` at the nominal costs, no message costs.")
    emit()
    cases, rows, skipped = [], [], []
    for M in Ms:
        for label, method, v in SYNC_ROWS:
            if method not in methods:
                continue
            try:
                build_schedule(method, D, v, M)
            except ConfigError as e:
                skipped.append(f"{label} at M={M}: {e}")
                continue
            cases.append((label, method, v, M))
    load_before = loadavg()[0]
    per_rank = run_distributed(sync_runs, D, pp=D, timeout=TIMEOUT, args=(cases, run_costs, t_step, mbs, warmup, reps))
    load_sync = loadavg()[0]
    ms_each = lambda costs, kinds: "/".join(f"{costs[k] * 1e3:.2f}" for k in kinds)  # noqa: E731
    for label, method, v, M in cases:
        results = [r[(label, M)] for r in per_rank]
        spans = [max(r[0][i][1] for r in results) - min(r[0][i][0] for r in results)
                 for i in range(warmup, warmup + reps)]
        measured, best = statistics.median(spans), min(spans)
        in_run = mean_over_ranks([r[1] for r in results])
        sim = sync_prediction(method, D, v, M, same_on_every_rank(tuple(c / v for c in nominal)), t_step=t_step)
        sim_cal = sync_prediction(method, D, v, M, same_on_every_rank(cal[v]), p2p, cal_step)
        sim_run = sync_prediction(method, D, v, M, in_run_costs([r[1] for r in results]), p2p_run, in_run["S"])
        rows.append([label, M, "-", f"{sim * 1e3:.1f}", f"{measured * 1e3:.1f}", ratio_cell(measured, sim),
                     f"{best / sim:.3f}", f"{measured / sim_cal:.3f}",
                     ms_each(in_run, "FBWSP" if in_run["W"] else "FBSP"), f"{measured / sim_run:.3f}", "-"])
        print("  ", rows[-1], flush=True)
    per_rank = run_distributed(async_runs, D, pp=D, timeout=TIMEOUT,
                               args=(intervals, N, run_costs, t_step, mbs, warmup, reps)) if intervals else None
    load_async = loadavg()[0]
    for k in intervals:
        per_mb, _, policy_s, _ = per_rank[D - 1]
        measured, best = statistics.median(per_mb[k]), min(per_mb[k])
        results = [r[3][k] for r in per_rank]
        in_run = mean_over_ranks(results)
        sim = async_prediction(D, k, N, same_on_every_rank(nominal), t_step=t_step)
        sim_cal = async_prediction(D, k, N, same_on_every_rank(cal[1]), p2p, cal_step)
        sim_run = async_prediction(D, k, N, in_run_costs(results), p2p_run, in_run["S"])
        label = f"async PipeOptim k={k}" + (f" (k = M at M={k})" if k in Ms else "")
        rows.append([label, "stream", k, f"{sim * 1e3:.2f}", f"{measured * 1e3:.2f}", ratio_cell(measured, sim),
                     f"{best / sim:.3f}", f"{measured / sim_cal:.3f}", ms_each(in_run, "FBSP"),
                     f"{measured / sim_run:.3f}", f"{statistics.median(policy_s[k]) * 1e3:.2f}"])
        print("  ", rows[-1], flush=True)
    emit("Synchronous rows: ms per iteration (M micro-batches, one step). Async rows: ms per micro-batch in the "
         "steady state. `measured`: the median repetition; `best`: the fastest one (the least disturbed by other "
         "load: it only adds time). `in-run op ms`: the wall time of one op inside these runs, the median "
         "repetition, the mean over ranks (F / B / [W /] step / posting one receive ahead; B of a fused backward "
         "includes its W; an op's waits in blocking receives excluded), and `sim run` the simulator with each "
         "rank's own such costs, the posting on the receiving op, and the measured receive cost and latency of a "
         "message: where it matches the measurement and `sim` does not, the gap is the ops getting slower on the "
         "loaded cores, not the simulator. `policy` = PipeOptim's hooks per micro-batch on the last rank "
         "(prediction, restore; not priced by the simulator).")
    emit()
    columns, repriced = COLUMNS, []
    if set(methods) != set(METHODS) and out_path and os.path.exists(out_path):
        rows, runs, repriced = merged(out_path, rows, run_of(out.lines)[0], methods, settings)
        columns = COLUMNS + ["run"]
        emit(f"Rows from {len({row[-1] for row in rows})} runs (column `run`): this one (the rows of "
             f"{', '.join(methods)}) and the rows of the other schedules kept from the file's earlier runs as they "
             "measured and priced them; each earlier run's command, machine, load, date, commit and one-process "
             "costs (those of the rows this run replaced too):")
        for line in runs:
            emit(line)
        emit()
    emit(markdown_table(columns, rows))
    emit()
    for line in skipped:
        emit(f"Not admitted: {line}")
    emit(f"Load average (1 min): {load_before:.2f} before the synchronous runs, {load_sync:.2f} after them"
         + (f", {load_async:.2f} after the asynchronous ones." if intervals else "; no asynchronous rows run."))
    emit()
    for line in summary(rows):
        emit(line)
    emit()
    if repriced:
        for line in repriced:
            emit(line)
        emit()
    emit(load_at_end(started))
    if out_path:
        out.write(out_path)
        print(f"\nwritten to {out_path}")
    return rows


def summary(rows):
    """How many rows are within 3 % of each pricing, and one line per row outside 3 % of `sim`: whether the
    measured op and message costs account for it."""
    within = lambda column: sum(abs(float(row[column].split()[0]) - 1) <= TOLERANCE for row in rows)  # noqa: E731
    flagged = sum("outside" in row[5] for row in rows)
    lines = [f"Within 3 % of `sim`: {len(rows) - flagged} of {len(rows)} rows; the best repetition: {within(6)}; "
             f"against `sim cal`: {within(7)}; against `sim run`: {within(9)}.", ""]
    for row in rows:
        if "outside" not in row[5]:
            continue
        label = row[0] if row[1] == "stream" else f"{row[0]} M={row[1]}"
        ratio, cal_ratio, run_ratio = (float(row[i].split()[0]) for i in (5, 7, 9))
        explained = [name for name, r in (("sim cal", cal_ratio), ("sim run", run_ratio)) if abs(r - 1) <= TOLERANCE]
        lines.append(f"- {label}: {ratio:.3f} of `sim`; " + (
            f"within 3 % of {' and '.join(explained)} ({cal_ratio:.3f}, {run_ratio:.3f}): the costs the simulator "
            "was not given (op overhead, message send / receive / latency) account for it" if explained else
            f"{cal_ratio:.3f} of `sim cal`, {run_ratio:.3f} of `sim run`: not accounted for by the measured costs "
            "either"))
    return lines


# --------------------------------------------------------------------------------------------------
# Rows of some schedules run again (--schedules), merged into the results file
# --------------------------------------------------------------------------------------------------


def run_of(lines):
    """(label, description) of the run a results file's opening `lines` describe: `commit date time`, and its
    command, machine, load and date, one-process costs and load line made one line."""
    command, machine = lines[0].removeprefix("Command: "), lines[2]
    label = (re.search(r"commit ([0-9a-f]+(?:-dirty)?)", machine)[1] + " "
             + re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", machine)[0])
    costs = [line for line in lines if line.startswith(("Per-op costs", "Load average (1 min)"))]
    return label, f"- run `{label}`: {command}; {machine.rstrip('.')}. " + " ".join(costs)


def table_rows(lines):
    """The cells of the results table's rows."""
    return [[c.strip() for c in line.split("|")[1:-1]] for line in lines
            if line.startswith("| ") and not line.startswith("| schedule")]


def row_key(row):
    """(method, interleaved, M, k) of a row ("async" the method of the stream)."""
    label = row[0]
    method = "async" if label.startswith("async") else next(w for w in label.split() if w in METHODS)
    return method, "v=2" in label, str(row[1]), str(row[2])


def merged(path, rows, this_run, methods, settings):
    """This run's rows (its label `this_run`) in place of the rows of `methods` in the results file at `path`,
    the other rows kept, each with its run's label; the description lines of the runs of the kept and the
    replaced rows; the replaced rows re-priced (`repriced`)."""
    lines = open(path).read().splitlines()
    unscripted = lambda line: re.sub(r"\S+\.py", "", line)  # noqa: E731  (the stages' module has moved since)
    if not any(unscripted(line).startswith(unscripted(settings)) for line in lines):
        raise SystemExit(f"--schedules: {path} was measured at other settings than this run's ({settings}); "
                         "run every schedule")
    own_label, own = run_of(lines)
    runs = {own_label: own, **{line.split("`")[1]: line for line in lines if line.startswith("- run `")}}
    old = [row if len(row) == len(COLUMNS) + 1 else row + [own_label] for row in table_rows(lines)
           if len(row) >= len(COLUMNS)]  # not the table of the rows an earlier merge replaced
    new = {row_key(row): [*map(str, row), this_run] for row in rows}
    out = [new.pop(row_key(row)) if row_key(row)[0] in methods else row for row in old
           if row_key(row)[0] not in methods or row_key(row) in new]
    out += new.values()  # rows the file did not have
    replaced = [row for row in old if row_key(row)[0] in methods]
    listed = {row[-1] for row in out + replaced} - {this_run}
    return out, [runs[label] for label in runs if label in listed], repriced(replaced, runs, settings)


def repriced(rows, runs, settings):
    """Lines: the replaced `rows`' `measured / sim cal` as their run printed it and at today's simulator, from
    the one-process op and message costs their run's description states (3 decimals in ms; the measured ms
    to 0.1 ms: the ratio to +-0.001). `sim run` needs each rank's in-run costs, which no run stores."""
    if not rows:
        return []
    D = int(re.match(r"D=(\d+)", settings)[1])
    N = 4 * max(int(M) for M in re.search(r"M in \[([\d, ]+)\]", settings)[1].split(","))
    table = []
    for row in rows:
        text = runs[row[-1]]
        x = r"([\d.]+)"
        cal = [float(c) / 1e3 for c in (re.search(rf"measured {x} / {x} / {x} and {x} / {x} / {x} ms", text) or
                                        re.search(rf"F / B / W: {x} / {x} / {x} ms per stage and {x} / {x} / {x}", text)
                                        ).groups()]
        step = float(re.search(rf"Step: {x} ms", text)[1]) / 1e3
        p2p = tuple(float(re.search(rf"{what} {x} ms", text)[1]) / 1e3 for what in (
            "receiver waiting", "send call", "data is there"))
        method, interleaved, M, k = row_key(row)
        v = 2 if interleaved or method == "zb-v" else 1
        costs = same_on_every_rank(cal[3 * (v - 1):3 * v])
        sim_cal = (async_prediction(D, int(k), N, costs, p2p, step) if method == "async" else
                   sync_prediction(method, D, v, int(M), costs, p2p, step))
        table.append([row[0], M, k, row[-1], row[4], row[7], f"{float(row[4]) / (sim_cal * 1e3):.3f}", row[9]])
    return ["The rows this run replaced, `measured / sim cal` as their run printed it and at today's simulator, from "
            "that run's one-process op and message costs stated above (to 3 decimals in ms, the measured ms to 0.1: "
            "the ratio to +-0.001); their `sim run` (as printed then) cannot be re-priced: it needs each rank's "
            "in-run op costs, which are not stored:", "",
            markdown_table(["schedule", "M", "k", "run", "measured ms", "measured / sim cal (then)",
                            "measured / sim cal (today)", "measured / sim run (then)"], table)]


def parse_args(argv=None):
    p = bench_common.parser(__doc__)
    zb.add_stage_arguments(p, stages=8, reps=5)
    p.add_argument("--M", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--t-step", type=float, default=0.007, help="optimizer step time, slept in every Step op (s)")
    p.add_argument("--quick", action="store_true",
                   help="D=4, M=2, one repetition, 5 ms ops, no trim (a smoke test: the trim's one-process "
                        "measurement is too noisy at that size on loaded cores)")
    p.add_argument("--schedules", nargs="+", choices=METHODS, default=METHODS, metavar="METHOD",
                   help=f"run these schedules' rows only ({', '.join(METHODS)}; default all); where --out exists, "
                        "they replace its rows of these schedules and its other rows are kept, each with the run it "
                        "came from, the replaced ones re-priced at today's simulator from their run's stated costs")
    p.add_argument("--out", default=os.path.join(bench_common.RESULTS, "simulator_check.md"))
    a = p.parse_args(argv)
    if a.quick:
        a.stages, a.M, a.tf, a.tB, a.tW, a.t_step, a.reps, a.warmup = 4, [2], 0.005, 0.005, 0.005, 0.002, 1, 0
        a.no_trim = True
    return a


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    bench_common.offline_env()
    run_check(a.stages, a.M, a.tf, a.tB, a.tW, a.t_step, a.mbs, a.warmup, a.reps, a.out, argv, trim=not a.no_trim,
              methods=a.schedules)
    return 0


if __name__ == "__main__":
    sys.exit(main())
