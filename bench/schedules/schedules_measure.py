"""bench/schedules/schedules.py's measuring: a rank's (start, end) of a run and the makespans over ranks, wall and
CPU time accumulated inside instrumented calls (the weight policy's hooks, the optimizer step), and the
simulator's bounds the measured throughput is compared with."""

from __future__ import annotations

import time

import torch.distributed as dist

from megatron_po.pipeline.async_pipeline import AsyncPipelineRank
from megatron_po.pipeline.schedules import Forward, build_schedule
from megatron_po.pipeline.simulator import simulate


def timed(fn):
    """Barrier, then run fn; return this rank's (start, end)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    return start, time.perf_counter()


def makespans(per_rank: list[list[tuple[float, float]]], warmup: int) -> list[float]:
    """Per repetition: max end - min start over ranks; warm-up repetitions dropped."""
    reps = len(per_rank[0])
    spans = [max(r[i][1] for r in per_rank) - min(r[i][0] for r in per_rank) for i in range(reps)]
    return spans[warmup:]


def accumulate(fn, acc: dict, key: str):
    """fn, adding its wall time to acc[key] (and its CPU time to acc[key + "_cpu"]) at every call."""
    def timed_fn(*args, **kwargs):
        t, c = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        acc[key] = acc.get(key, 0.0) + time.perf_counter() - t
        acc[key + "_cpu"] = acc.get(key + "_cpu", 0.0) + time.thread_time() - c
        return out
    return timed_fn


def steady_window(M: int) -> tuple[int, int, int]:
    """Segment length N and the window [a, b) of micro-batches whose losses time the steady state."""
    return 4 * M, M, 3 * M


def bound(method, D, v, M, t_f_chunk, t_b_chunk, t_p2p):
    """Simulated micro-batches/s of an iteration of M micro-batches; costs are per virtual stage."""
    return M / simulate(build_schedule(method, D, v, M), t_f_chunk, t_b_chunk, t_p2p).makespan


def async_bound(D, M, t_f, t_b, t_p2p):
    """Simulated steady-state micro-batches/s of the async stream, timed as the benchmark does: the end of
    the last stage's forwards a and b (where the loss is computed) in a segment of N = 4M."""
    N, a, b = steady_window(M)
    timeline = simulate(build_schedule("async", D, 1, N), t_f, t_b, t_p2p)
    end = {e.op.microbatch: e.end for e in timeline.events if e.rank == D - 1 and isinstance(e.op, Forward)}
    return (b - a) / (end[b] - end[a])


POLICY_HOOKS = ("before_forward", "after_forward", "before_backward", "after_backward", "before_step", "after_step")


def instrument(rank: AsyncPipelineRank, acc: dict) -> None:
    """Accumulate the wall and CPU time spent in the weight policy's hooks (acc["policy"], acc["policy_cpu"])
    and in the optimizer step function (acc["step"], ...) of this rank. Wraps the instance's bound methods;
    the library is untouched (StageRunner calls `policy.<hook>`, AsyncStage passes `self.step` as step_fn)."""
    policy = rank.stage.policy
    for hook in POLICY_HOOKS:
        setattr(policy, hook, accumulate(getattr(policy, hook), acc, "policy"))
    rank.stage.step = accumulate(rank.stage.step, acc, "step")
