"""bench/convergence/convergence.py's measuring: per-op wall times recorded inside the emulator runs (with the part
spent in the weight policy's hooks), op costs out of them, and the simulated pipeline throughput those
costs give each method's schedule (`megatron_po.pipeline.simulator.simulate`)."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict


def _op_costs(times: dict) -> dict:
    """{(rank, kind): [seconds]} -> {"rank": {kind: seconds}} (string keys, as after a JSON round trip).

    The cost of an op is the 10th percentile of its measured times: the machine is shared, and the
    least-disturbed executions estimate the op's own cost far more stably than the median does."""
    out: dict = defaultdict(dict)
    for (rank, kind), values in times.items():
        out[str(rank)][kind] = _percentile10(values)
    return {r: out[r] for r in sorted(out, key=int)}


HOOKS = ("before_forward", "after_forward", "before_backward", "after_backward", "before_step", "after_step")


def _time_runners(emulator, times: dict) -> None:
    """Record, per (rank, op kind), the wall time of every training op and (kind + "Hooks") the part of
    it spent in the weight policy's hooks (prediction, stashing, swaps, 2BW's version copy)."""
    for stage in emulator.stages:
        in_hooks = [0.0]
        for name in HOOKS:
            setattr(stage.policy, name, _timed_hook(getattr(stage.policy, name), in_hooks))
        make_runner = stage.runner

        def runner(*args, _make=make_runner, _rank=stage.rank, _hooks=in_hooks, **kwargs):
            r = _make(*args, **kwargs)
            r.run = _timed(r.run, _rank, times, _hooks)
            return r
        stage.runner = runner


def _timed_hook(hook, in_hooks: list):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = hook(*args, **kwargs)
        in_hooks[0] += time.perf_counter() - t0
        return out
    return timed


def _timed(run, rank: int, times: dict, in_hooks: list | None = None):
    def timed(op, *args, **kwargs):
        if in_hooks is not None:
            in_hooks[0] = 0.0
        t0 = time.perf_counter()
        run(op, *args, **kwargs)
        kind = type(op).__name__
        times[(rank, kind)].append(time.perf_counter() - t0)
        if in_hooks is not None:
            times[(rank, kind + "Hooks")].append(in_hooks[0])
    return timed


def _async_op_costs(times: dict[str, dict], D: int) -> dict[str, dict]:
    """Per asynchronous method: {"rank": {kind: cost}} = the shared base cost of the op (10th percentile
    of op time minus hook time, pooled over every method: the same model code runs in all of them) plus
    the method's own hook cost (median: the typical policy work per op). Noise in the base then cannot
    separate the methods; only their weight-policy work and their schedules do."""
    base = {}
    for r in range(D):
        for kind in ("Forward", "Backward", "Step"):
            pooled = [total - hooks for m in times for total, hooks in
                      zip(times[m][(r, kind)], times[m][(r, kind + "Hooks")])]
            base[(r, kind)] = _percentile10(pooled)
    return {m: {str(r): {kind: base[(r, kind)] + _median(times[m][(r, kind + "Hooks")])
                         for kind in ("Forward", "Backward", "Step")} for r in range(D)} for m in times}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _percentile10(values: list[float]) -> float:
    values = sorted(values)
    return values[int(0.1 * (len(values) - 1))] if values else 0.0


def _stage_costs(op_times: dict, D: int, k: int = 1):
    """Per-stage forward and backward cost lists; a stage's step cost is folded into its backwards
    (1/k of it per backward, as the stage steps after every k)."""
    t_f = [op_times[str(r)]["Forward"] for r in range(D)]
    t_b = [op_times[str(r)]["Backward"] + op_times[str(r)].get("Step", 0.0) / k for r in range(D)]
    return t_f, t_b


def async_tokens_per_s(op_times: dict, D: int, k: int, tokens_per_mb: int) -> float:
    """Steady state of the no-flush stream: (N2 - N1) micro-batches over T(N2) - T(N1), fill and drain cancel."""
    from megatron_po.pipeline.schedules import async_one_f_one_b
    from megatron_po.pipeline.simulator import simulate
    t_f, t_b = _stage_costs(op_times, D, k)
    n1, n2 = 4 * D * k, 8 * D * k
    t1 = simulate(async_one_f_one_b(D, 1, n1, k), t_f, t_b).makespan
    t2 = simulate(async_one_f_one_b(D, 1, n2, k), t_f, t_b).makespan
    return (n2 - n1) * tokens_per_mb / (t2 - t1)


def sync_seconds_per_update(schedule: str, op: dict, D: int, M: int, scale: float = 1.0) -> float:
    """One flush of M micro-batches of a synchronous schedule (1F1B, GPipe, interleaved 1F1B at v = 2, ZB-H1) on
    per-op costs `op` ({"rank": {kind: seconds}}, each op costing `scale` x its cost) + the slowest stage's step.
    Interleaving: each chunk costs half its stage; ZB-H1: the backward split into input and weight gradients
    (BackwardInput / BackwardWeight where `op` has them, else half of the backward each)."""
    from megatron_po.pipeline.schedules import build_schedule
    from megatron_po.pipeline.simulator import simulate
    t_f = [op[str(r)]["Forward"] * scale for r in range(D)]
    t_b = [op[str(r)]["Backward"] * scale for r in range(D)]
    step = max(op[str(r)]["Step"] for r in range(D))
    if schedule == "interleaved-1f1b":
        half = lambda t: [t[vs % D] / 2 for vs in range(2 * D)]  # noqa: E731 (vs = chunk*D + rank)
        makespan = simulate(build_schedule("interleaved-1f1b", D, 2, M), half(t_f), half(t_b)).makespan
    elif schedule == "zb-h1":
        t_bi = [op[str(r)].get("BackwardInput", op[str(r)]["Backward"] / 2) * scale for r in range(D)]
        t_w = [op[str(r)].get("BackwardWeight", op[str(r)]["Backward"] / 2) * scale for r in range(D)]
        makespan = simulate(build_schedule("zb-h1", D, 1, M), t_f, t_bi, t_weight=t_w).makespan
    else:
        makespan = simulate(build_schedule(schedule, D, 1, M), t_f, t_b).makespan
    return makespan + step
