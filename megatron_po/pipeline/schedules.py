"""Pipeline schedules as data: for every pipeline rank, the ordered list of ops it runs.

A schedule is made by a pure function `(num_stages, num_chunks, num_microbatches) -> Schedule` (no
torch, no process groups). The same op lists drive the distributed executor, the single-process
emulator and the timeline simulator (simulator.py), so what the tests prove about a schedule here
(every forward before its backward, every input produced by the neighbouring stage, no deadlock) holds
for the real run.

Notation: D = num_stages (pipeline ranks), v = num_chunks (model chunks per rank, "virtual pipeline"),
M = num_microbatches. Rank r with chunk c is virtual stage `c*D + r` (Megatron's numbering): virtual
stage 0 holds the embedding, virtual stage v*D-1 (rank D-1, chunk v-1) holds the loss.

The ops (`Forward`, `Backward`, zero bubble's `BackwardInput`/`BackwardWeight`, `Step`), the `Schedule`
and the communication an op implies live in schedule_ops.py (below this module and zero_bubble.py, whose
schedules `build_schedule` also builds); they are imported here, so callers keep importing them from
this module. The executor posts sends as isend (never blocking) and receives blocking;
`check_schedule` simulates exactly these semantics to prove a schedule cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_po.errors import ConfigError
# Also the names callers import from here (loss_rank, message_tag, placement_of, ...: hence the noqa).
from megatron_po.pipeline.schedule_ops import (GRADIENT_DONE, Backward, BackwardInput, BackwardWeight,  # noqa: F401
                                               Forward, MessageKey, Op, Schedule, Step, check_sizes,
                                               check_stream_interleaved, comm_of, interleaved_order, loss_rank,
                                               message_tag, microbatch_groups, op_label, placement_of,
                                               rank_chunk_of, tag_period, virtual_stage)
from megatron_po.pipeline.zero_bubble import ZB_SCHEDULES


# --------------------------------------------------------------------------------------------------
# Builders. Each returns a Schedule; all validate D, v, M first.
# --------------------------------------------------------------------------------------------------


def no_pipelining(num_stages: int, num_chunks: int, num_microbatches: int) -> Schedule:
    """Gradient accumulation on one stage: F0 B0 F1 B1 ... Step. With v > 1 chunks, each micro-batch
    runs forward through chunks 0..v-1 and backward through v-1..0."""
    check_sizes(num_stages, num_chunks, num_microbatches)
    if num_stages != 1:
        raise ConfigError(f"pipeline method 'none' needs num_stages == 1, got num_stages={num_stages}")
    ops: list[Op] = []
    for mb in range(num_microbatches):
        ops += [Forward(mb, c) for c in range(num_chunks)]
        ops += [Backward(mb, c) for c in reversed(range(num_chunks))]
    return Schedule("none", 1, num_chunks, num_microbatches, {0: ops + [Step(None)]})


def gpipe(num_stages: int, num_chunks: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards (in micro-batch order), then one Step.

    With v > 1 chunks a rank runs its virtual stages in the order a GPipe over D*v stages would: all
    micro-batches through chunk 0, then through chunk 1, ...; backwards chunk v-1 first. (Chunk-major,
    so the pipeline stays full when M >= D.)
    """
    check_sizes(num_stages, num_chunks, num_microbatches)
    M, v = num_microbatches, num_chunks
    forwards = [Forward(mb, c) for c in range(v) for mb in range(M)]
    backwards = [Backward(mb, c) for c in reversed(range(v)) for mb in range(M)]
    ops = {r: forwards + backwards + [Step(None)] for r in range(num_stages)}
    return Schedule("gpipe", num_stages, v, M, ops)


def _warmup(rank: int, num_stages: int, num_chunks: int, num_microbatches: int) -> int:
    """Forwards a rank runs before its first backward.

    v = 1: PipeDream-Flush's D-r-1. v > 1: Megatron's (D-r-1)*2 + (v-1)*N, N the first (largest)
    micro-batch group (`microbatch_groups`; N = D when M % D == 0): the rank must have run the
    first group through chunks 0..v-2 before its first backward (of the last chunk) can be ready, and the
    factor 2 lets it keep computing while that gradient makes the round trip through the later ranks.
    Megatron would also give 2*(D-r-1) for v = 1, but we use D-r-1 there so the interleaved schedule with
    one chunk is exactly 1F1B.
    """
    D, v, M = num_stages, num_chunks, num_microbatches
    w = D - rank - 1 if v == 1 else (D - rank - 1) * 2 + (v - 1) * microbatch_groups(D, M)[0]
    return min(w, M * v)


def _one_f_one_b_ops(forwards: list[tuple[int, int]], backwards: list[tuple[int, int]],
                     num_warmup: int) -> list[Op]:
    """Warm-up forwards, then (forward, backward) pairs, then the cool-down backwards."""
    n = len(forwards)
    ops: list[Op] = [Forward(*f) for f in forwards[:num_warmup]]
    for i in range(n - num_warmup):
        ops += [Forward(*forwards[num_warmup + i]), Backward(*backwards[i])]
    ops += [Backward(*b) for b in backwards[n - num_warmup:]]
    return ops


def one_f_one_b(num_stages: int, num_chunks: int, num_microbatches: int) -> Schedule:
    """PipeDream-Flush: rank r runs min(D-r-1, M) warm-up forwards, then one-forward-one-backward,
    then the cool-down backwards, then Step. At most D-r micro-batches in flight on rank r."""
    check_sizes(num_stages, num_chunks, num_microbatches)
    if num_chunks != 1:
        raise ConfigError(f"1f1b needs num_chunks == 1, got num_chunks={num_chunks} "
                          "(use interleaved-1f1b)")
    D, M = num_stages, num_microbatches
    order = interleaved_order(D, 1, M, forward=True)
    ops = {r: _one_f_one_b_ops(order, order, _warmup(r, D, 1, M)) + [Step(None)] for r in range(D)}
    return Schedule("1f1b", D, 1, M, ops)


def interleaved_one_f_one_b(num_stages: int, num_chunks: int, num_microbatches: int) -> Schedule:
    """Megatron's interleaved 1F1B: forwards and backwards in `interleaved_order`, warm-up
    `_warmup`, steady 1F1B, cool-down, Step. Works for D = 2 (Megatron forbids it) and for v = 1,
    where it equals `one_f_one_b`.

    Any M >= 1: micro-batches run in groups of at least D (`microbatch_groups`), or one group of M when
    M < D (Megatron refuses M < D). Unlike Megatron we do not switch to all-forwards-then-all-backwards
    when M == D: with isend and a blocking recv the regular order cannot deadlock there either
    (check_schedule proves it).
    """
    check_sizes(num_stages, num_chunks, num_microbatches)
    D, v, M = num_stages, num_chunks, num_microbatches
    forwards = interleaved_order(D, v, M, forward=True)
    backwards = interleaved_order(D, v, M, forward=False)
    ops = {r: _one_f_one_b_ops(forwards, backwards, _warmup(r, D, v, M)) + [Step(None)]
           for r in range(D)}
    return Schedule("interleaved-1f1b", D, v, M, ops)


def _step_every(ops: list[Op], update_interval: int) -> list[Op]:
    """Insert Step(c) after every `update_interval`-th backward of chunk c.

    A partial group (fewer than k backwards left when the stream ends) is stepped right after the
    chunk's last backward, so no accumulated gradient is lost at the drain.
    """
    last_backward = {op.chunk: i for i, op in enumerate(ops) if isinstance(op, Backward)}
    count: dict[int, int] = {}
    out: list[Op] = []
    for i, op in enumerate(ops):
        out.append(op)
        if isinstance(op, Backward):
            count[op.chunk] = count.get(op.chunk, 0) + 1
            if count[op.chunk] % update_interval == 0 or i == last_backward[op.chunk]:
                out.append(Step(op.chunk))
    return out


def async_one_f_one_b(num_stages: int, num_chunks: int, num_microbatches: int,
                      update_interval: int = 1) -> Schedule:
    """Streaming 1F1B without a flush, the base of the asynchronous methods.

    Same forward/backward order as (interleaved) 1F1B over a stream of M micro-batches, but each rank
    steps chunk c on its own after every `update_interval` (k) backwards of that chunk (Step(c)), and
    there is no Step(None): micro-batches in flight carry over from one iteration to the next. For
    v = 1 rank r runs F(0)..F(w-1) with w = D-r-1, then F(w+i) B(i) [Step], then drains. Running the
    schedule for M micro-batches is one segment of the endless stream; its drain only happens when
    training ends.
    """
    check_sizes(num_stages, num_chunks, num_microbatches)
    if not isinstance(update_interval, int) or update_interval < 1:
        raise ConfigError(f"update_interval must be an integer >= 1, got {update_interval!r}")
    check_stream_interleaved(num_stages, num_chunks, num_microbatches, "async 1f1b")
    D, v, M = num_stages, num_chunks, num_microbatches
    forwards = interleaved_order(D, v, M, forward=True)
    backwards = interleaved_order(D, v, M, forward=False)
    ops = {r: _step_every(_one_f_one_b_ops(forwards, backwards, _warmup(r, D, v, M)), update_interval)
           for r in range(D)}
    return Schedule("async", D, v, M, ops)


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "none": no_pipelining,
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_one_f_one_b,
    "async": async_one_f_one_b,
}


def build_schedule(method: str, num_stages: int, num_chunks: int, num_microbatches: int,
                   update_interval: int = 1) -> Schedule:
    """The schedule for a method name; "1f1b" with num_chunks > 1 means interleaved-1f1b.
    `update_interval` (k) only applies to "async"."""
    if method in ZB_SCHEDULES and update_interval == 1:
        return ZB_SCHEDULES[method](num_stages, num_chunks, num_microbatches)
    if method not in SCHEDULES and method not in ZB_SCHEDULES:
        valid = ", ".join([*SCHEDULES, *ZB_SCHEDULES])
        raise ConfigError(f"unknown pipeline schedule {method!r}; valid: {valid}")
    if method == "1f1b" and num_chunks > 1:
        method = "interleaved-1f1b"
    if method == "async":
        return async_one_f_one_b(num_stages, num_chunks, num_microbatches, update_interval)
    if update_interval != 1:
        raise ConfigError(f"update_interval={update_interval} only applies to the async schedule, "
                          f"not {method!r} (synchronous schedules step once per iteration)")
    return SCHEDULES[method](num_stages, num_chunks, num_microbatches)


# --------------------------------------------------------------------------------------------------
# Checking: invariants, execution order (deadlock), stats, staleness.
# --------------------------------------------------------------------------------------------------


class DeadlockError(ValueError):
    """Ranks running their op lists with isend + blocking recv would wait on each other forever."""


def execution_order(schedule: Schedule) -> list[tuple[int, int]]:
    """(rank, op index) pairs in an order every op can run in: ranks run their ops in list order, a
    receive waits until the matching send has happened, a send never waits (isend).

    Any such order is a topological order of the op dependency graph, which is what the simulator
    needs. Raises DeadlockError naming each stuck op and what it waits for; ValueError when a
    message is received twice or sent to a rank that never receives it.
    """
    D, v = schedule.num_stages, schedule.num_chunks
    ops = schedule.ops
    sent: set[tuple[int, MessageKey]] = set()  # (destination rank, key) sent and not yet received
    position = {r: 0 for r in range(D)}
    order: list[tuple[int, int]] = []
    progress = True
    while progress:
        progress = False
        for r in range(D):
            while position[r] < len(ops[r]):
                op = ops[r][position[r]]
                recv, send = comm_of(op, r, D, v, schedule.placement)
                if recv is not None:
                    if (r, recv[1]) not in sent:
                        break
                    sent.remove((r, recv[1]))
                if send is not None:
                    if (send[0], send[1]) in sent:
                        raise ValueError(f"rank {r} {op_label(op, v)} sends {send[1]} to rank {send[0]} "
                                         "a second time before it was received")
                    sent.add((send[0], send[1]))
                order.append((r, position[r]))
                position[r] += 1
                progress = True
    stuck = [r for r in range(D) if position[r] < len(ops[r])]
    if stuck:
        lines = []
        for r in stuck:
            op = ops[r][position[r]]
            src, key = comm_of(op, r, D, v, schedule.placement)[0]
            lines.append(f"rank {r} at op #{position[r]} {op_label(op, v)} waits for {key[0]} of "
                         f"micro-batch {key[1]} (virtual stage {key[2]}) from rank {src}")
        raise DeadlockError(f"{schedule.name} D={D} v={v} M={schedule.num_microbatches} deadlocks: "
                            + "; ".join(lines))
    if sent:
        raise ValueError(f"{schedule.name}: messages sent but never received: {sorted(sent)}")
    return order


@dataclass
class ScheduleStats:
    peak_activations: dict[int, int]  # rank -> max forwards whose backward (split: W) has not run yet
    ops_per_rank: dict[int, int]
    total_ops: int
    num_messages: int  # hand-offs between virtual stages implied by the ops (sends)
    local_messages: int = 0  # of them, those to a chunk on the sending rank itself: no transfer (ZB-V's turn)


def check_schedule(schedule: Schedule) -> ScheduleStats:
    """Assert the invariants every schedule must satisfy and return its stats.

    - ranks are exactly 0..D-1; chunks are in 0..v-1;
    - on every rank each (mb, chunk) for mb < M, chunk < v appears exactly once as Forward and once as
      Backward (or once as BackwardInput and then once as BackwardWeight), the Forward first;
    - every chunk's gradient is stepped: after the last Backward of a chunk comes a Step of that chunk
      or Step(None) (asynchronous schedules step per chunk; synchronous ones end with Step(None));
    - every input is produced by the neighbouring virtual stage and the ranks cannot deadlock
      (`execution_order`).
    Raises ValueError (DeadlockError for a deadlock) with a one-line description.
    """
    D, v, M = schedule.num_stages, schedule.num_chunks, schedule.num_microbatches
    name = f"{schedule.name} D={D} v={v} M={M}"
    if sorted(schedule.ops) != list(range(D)):
        raise ValueError(f"{name}: ops must be given for ranks 0..{D - 1}, got {sorted(schedule.ops)}")
    expected = {(mb, c) for mb in range(M) for c in range(v)}
    peak: dict[int, int] = {}
    for r, ops in schedule.ops.items():
        done_forward: set[tuple[int, int]] = set()
        done_input: set[tuple[int, int]] = set()  # BackwardInput run, BackwardWeight not yet
        done_backward: set[tuple[int, int]] = set()  # weight gradient complete (Backward or BackwardWeight)
        stepped_after_last_backward = {c: True for c in range(v)}
        alive = peak[r] = 0
        for op in ops:
            if isinstance(op, Step):
                if op.chunk is not None and not 0 <= op.chunk < v:
                    raise ValueError(f"{name}: rank {r} steps chunk {op.chunk} outside 0..{v - 1}")
                for c in (range(v) if op.chunk is None else [op.chunk]):
                    stepped_after_last_backward[c] = True
                continue
            key = (op.microbatch, op.chunk)
            if key not in expected:
                raise ValueError(f"{name}: rank {r} runs {op_label(op, v)}, outside mb < {M}, chunk < {v}")
            if isinstance(op, Forward):
                if key in done_forward:
                    raise ValueError(f"{name}: rank {r} runs {op_label(op, v)} twice")
                done_forward.add(key)
                alive += 1
                peak[r] = max(peak[r], alive)
                continue
            if key not in done_forward:
                raise ValueError(f"{name}: rank {r} runs {op_label(op, v)} before its forward")
            if key in done_backward or (key in done_input and not isinstance(op, BackwardWeight)):
                raise ValueError(f"{name}: rank {r} runs {op_label(op, v)} twice")
            if isinstance(op, BackwardInput):
                done_input.add(key)
                continue
            if isinstance(op, BackwardWeight):
                if key not in done_input:
                    raise ValueError(f"{name}: rank {r} runs {op_label(op, v)} before its BackwardInput")
                done_input.remove(key)
            done_backward.add(key)
            alive -= 1  # activations (and saved output gradients) are freed once the weight gradient is done
            stepped_after_last_backward[op.chunk] = False
        missing = sorted(expected - done_backward)
        if missing:
            mb, c = missing[0]
            raise ValueError(f"{name}: rank {r} never runs {op_label(Backward(mb, c), v)} "
                             f"({len(missing)} (mb, chunk) backwards missing)")
        lost = [c for c, ok in stepped_after_last_backward.items() if not ok]
        if lost:
            raise ValueError(f"{name}: rank {r} has no Step after the last backward of chunk(s) {lost}: "
                             "their gradients are never applied")
    order = execution_order(schedule)
    sends = [(r, comm_of(schedule.ops[r][i], r, D, v, schedule.placement)[1]) for r, i in order]
    sends = [(r, send) for r, send in sends if send is not None]
    per_rank = {r: len(ops) for r, ops in schedule.ops.items()}
    return ScheduleStats(peak, per_rank, sum(per_rank.values()), len(sends),
                         sum(send[0] == r for r, send in sends))


def staleness(schedule: Schedule) -> dict[tuple[int, int], dict[int, int]]:
    """s(mb) per (rank, chunk): the number of optimizer steps that chunk takes between F(mb) and B(mb)
    in the rank's op list (Step(None) counts for every chunk). Derived from the ops, nothing assumed:
    0 everywhere for synchronous schedules, D-r-1 in the steady state of straight async 1F1B, k = 1."""
    v = schedule.num_chunks
    result: dict[tuple[int, int], dict[int, int]] = {}
    for r, ops in schedule.ops.items():
        steps = [0] * v
        at_forward: dict[tuple[int, int], int] = {}
        for c in range(v):
            result[(r, c)] = {}
        for op in ops:
            if isinstance(op, Step):
                for c in (range(v) if op.chunk is None else [op.chunk]):
                    steps[c] += 1
            elif isinstance(op, Forward):
                at_forward[(op.microbatch, op.chunk)] = steps[op.chunk]
            elif isinstance(op, GRADIENT_DONE):
                result[(r, op.chunk)][op.microbatch] = (
                    steps[op.chunk] - at_forward[(op.microbatch, op.chunk)])
    return result
