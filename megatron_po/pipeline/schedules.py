"""Pipeline schedules as data: for every pipeline rank, the ordered list of ops it runs.

A schedule is made by a pure function `(num_stages, num_chunks, num_microbatches) -> Schedule` (no
torch, no process groups). The same op lists drive the distributed executor, the single-process
emulator and the timeline simulator (simulator.py), so what the tests prove about a schedule here
(every forward before its backward, every input produced by the neighbouring stage, no deadlock) holds
for the real run.

Notation: D = num_stages (pipeline ranks), v = num_chunks (model chunks per rank, "virtual pipeline"),
M = num_microbatches. Rank r with chunk c is virtual stage `c*D + r` (Megatron's numbering): virtual
stage 0 holds the embedding, virtual stage v*D-1 (rank D-1, chunk v-1) holds the loss.

Communication is implied by the ops, never listed: `Forward(mb, c)` on rank r receives the activation
of virtual stage vs-1 (unless vs is the first) and sends one to vs+1 (unless vs is the last);
`Backward(mb, c)` receives the gradient from vs+1 (unless vs holds the loss) and sends one to vs-1
(unless vs is the first). Zero-bubble schedules (zero_bubble.py) split it: `BackwardInput(mb, c)`
communicates exactly as `Backward` and computes the gradient w.r.t. the stage input; `BackwardWeight(mb, c)`
(later, no communication) computes the weight gradients from what BackwardInput left. The executor posts sends as isend (never blocking) and receives blocking;
`check_schedule` simulates exactly these semantics to prove a schedule cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

from megatron_po.errors import ConfigError

# --------------------------------------------------------------------------------------------------
# Ops: tiny, frozen, hashable.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Forward:
    microbatch: int
    chunk: int = 0


@dataclass(frozen=True)
class Backward:
    microbatch: int
    chunk: int = 0


@dataclass(frozen=True)
class BackwardInput:
    """B of zero-bubble pipelining: gradient w.r.t. the stage input only (sent upstream at once)."""
    microbatch: int
    chunk: int = 0


@dataclass(frozen=True)
class BackwardWeight:
    """W of zero-bubble pipelining: the weight gradients of a micro-batch whose BackwardInput ran."""
    microbatch: int
    chunk: int = 0


@dataclass(frozen=True)
class Step:
    """Optimizer step. `chunk=None`: all chunks of the rank, after the data-parallel gradient sync
    (the synchronous end of an iteration). `chunk=c`: only chunk c (asynchronous methods)."""

    chunk: int | None = None


Op = Union[Forward, Backward, BackwardInput, BackwardWeight, Step]
BACKWARD_TO_INPUT = (Backward, BackwardInput)  # ops that receive/send gradients
GRADIENT_DONE = (Backward, BackwardWeight)  # ops after which a micro-batch's weight gradient is complete


def op_label(op: Op, num_chunks: int) -> str:
    """`F3.1` = forward of micro-batch 3 on chunk 1; `B3` when v = 1; `S` = Step(None); `S.1` = Step(1)."""
    if isinstance(op, Step):
        return "S" if op.chunk is None or num_chunks == 1 else f"S.{op.chunk}"
    letter = {Forward: "F", Backward: "B", BackwardInput: "B", BackwardWeight: "W"}[type(op)]
    return f"{letter}{op.microbatch}" if num_chunks == 1 else f"{letter}{op.microbatch}.{op.chunk}"


@dataclass
class Schedule:
    name: str
    num_stages: int  # D
    num_chunks: int  # v
    num_microbatches: int  # M
    ops: dict[int, list[Op]] = field(default_factory=dict)  # rank -> ops in execution order
    placement: str = "interleaved"  # how (rank, chunk) maps to virtual stages: see `virtual_stage`

    def __str__(self) -> str:
        labels = {r: [op_label(op, self.num_chunks) for op in ops] for r, ops in self.ops.items()}
        width = max((len(s) for row in labels.values() for s in row), default=1)
        head = f"{self.name}: D={self.num_stages} v={self.num_chunks} M={self.num_microbatches}"
        rows = [f"rank {r:>2} | " + " ".join(s.ljust(width) for s in labels[r]).rstrip()
                for r in sorted(labels)]
        return "\n".join([head] + rows)


# --------------------------------------------------------------------------------------------------
# Virtual stages and the communication an op implies.
# --------------------------------------------------------------------------------------------------


PLACEMENTS = ("interleaved", "v")


def placement_of(method: str) -> str:
    """The chunk placement a pipeline method needs: "v" for ZB-V, else Megatron's interleaving."""
    return "v" if method == "zb-v" else "interleaved"


def loss_rank(method: str, num_stages: int) -> int:
    """The pipeline rank holding the last virtual stage (the loss): rank 0 under ZB-V, else D-1."""
    return 0 if placement_of(method) == "v" else num_stages - 1


def virtual_stage(rank: int, chunk: int, num_stages: int, placement: str = "interleaved") -> int:
    """"interleaved" (Megatron): vs = chunk*D + rank. "v" (ZB-V, 2 chunks): chunk 0 goes down the ranks
    (vs = rank), chunk 1 comes back up (vs = 2D-1-rank), so rank 0 holds the first and the last stage."""
    if placement == "v":
        return rank if chunk == 0 else 2 * num_stages - 1 - rank
    return chunk * num_stages + rank


def rank_chunk_of(vs: int, num_stages: int, placement: str = "interleaved") -> tuple[int, int]:
    if placement == "v":
        return (vs, 0) if vs < num_stages else (2 * num_stages - 1 - vs, 1)
    return vs % num_stages, vs // num_stages


MessageKey = tuple  # ("act" | "grad", microbatch, destination virtual stage)


def comm_of(op: Op, rank: int, num_stages: int, num_chunks: int, placement: str = "interleaved"
            ) -> tuple[tuple[int, MessageKey] | None, tuple[int, MessageKey] | None]:
    """(recv_from, send_to) of `op` run on `rank`; each is `(peer_rank, key)` or None.

    key = ("act", mb, dest_vs) for a forward activation, ("grad", mb, dest_vs) for a backward gradient;
    dest_vs is the virtual stage that consumes the message, so the receiver's key equals the sender's.
    """
    if isinstance(op, (Step, BackwardWeight)):
        return None, None
    vs = virtual_stage(rank, op.chunk, num_stages, placement)
    last = num_stages * num_chunks - 1
    mb = op.microbatch
    peer = lambda x: rank_chunk_of(x, num_stages, placement)[0]  # noqa: E731
    if isinstance(op, Forward):
        recv = (peer(vs - 1), ("act", mb, vs)) if vs > 0 else None
        send = (peer(vs + 1), ("act", mb, vs + 1)) if vs < last else None
    else:
        recv = (peer(vs + 1), ("grad", mb, vs)) if vs < last else None
        send = (peer(vs - 1), ("grad", mb, vs - 1)) if vs > 0 else None
    return recv, send


def tag_period(num_stages: int, num_chunks: int) -> int:
    """Micro-batch ids are taken modulo this period inside p2p tags (see `message_tag`)."""
    return 2**31 // (2 * num_stages * num_chunks)


def message_tag(kind: str, microbatch: int, dest_vs: int, num_chunks: int, num_stages: int) -> int:
    """A p2p tag in [0, 2**31) unique per (kind, microbatch, destination virtual stage).

    Activations and gradients get different tags even between the same two ranks (with D = 2 the next
    and the previous rank are the same peer). Asynchronous schedules stream micro-batches forever, so
    the micro-batch id is taken modulo `tag_period(D, v)` = 2**31 // (2*D*v) (about 2.7e8 for D*v = 4):
    two messages share a tag only if their micro-batch ids differ by a multiple of that period, and
    never that many micro-batches are in flight between two ranks at once.
    """
    if kind not in ("act", "grad"):
        raise ValueError(f"message kind must be 'act' or 'grad', got {kind!r}")
    num_vs = num_stages * num_chunks
    if not 0 <= dest_vs < num_vs:
        raise ValueError(f"dest_vs={dest_vs} outside 0..{num_vs - 1}")
    mb = microbatch % tag_period(num_stages, num_chunks)
    return (mb * num_vs + dest_vs) * 2 + (kind == "grad")


# --------------------------------------------------------------------------------------------------
# Builders. Each returns a Schedule; all validate D, v, M first.
# --------------------------------------------------------------------------------------------------


def _check_sizes(num_stages: int, num_chunks: int, num_microbatches: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_chunks", num_chunks),
                        ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


def no_pipelining(num_stages: int, num_chunks: int, num_microbatches: int) -> Schedule:
    """Gradient accumulation on one stage: F0 B0 F1 B1 ... Step. With v > 1 chunks, each micro-batch
    runs forward through chunks 0..v-1 and backward through v-1..0."""
    _check_sizes(num_stages, num_chunks, num_microbatches)
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
    _check_sizes(num_stages, num_chunks, num_microbatches)
    M, v = num_microbatches, num_chunks
    forwards = [Forward(mb, c) for c in range(v) for mb in range(M)]
    backwards = [Backward(mb, c) for c in reversed(range(v)) for mb in range(M)]
    ops = {r: forwards + backwards + [Step(None)] for r in range(num_stages)}
    return Schedule("gpipe", num_stages, v, M, ops)


def _interleaved_order(num_stages: int, num_chunks: int, num_microbatches: int, forward: bool
                       ) -> list[tuple[int, int]]:
    """(microbatch, chunk) pairs in the order every rank runs its forwards (or backwards).

    Megatron-core's `get_model_chunk_id`: iteration ids walk micro-batches in groups of D; within a
    group of D*v ids, chunk = (id mod D*v) // D; backwards mirror the chunk (v-1-c) so the last virtual
    stage's backward comes first. With v = 1 this is just micro-batches 0..M-1.
    """
    D, v = num_stages, num_chunks
    order = []
    for i in range(num_microbatches * v):
        group, within = divmod(i, D * v)
        chunk = within // D
        mb = group * D + within % D
        order.append((mb, chunk if forward else v - 1 - chunk))
    return order


def _warmup(rank: int, num_stages: int, num_chunks: int, num_microbatches: int) -> int:
    """Forwards a rank runs before its first backward.

    v = 1: PipeDream-Flush's D-r-1. v > 1: Megatron's (D-r-1)*2 + (v-1)*D. The factor 2 lets a rank
    keep computing while its first gradient makes the round trip through the later ranks; Megatron
    would also give 2*(D-r-1) for v = 1, but we use D-r-1 there so the interleaved schedule with one
    chunk is exactly 1F1B.
    """
    D, v, M = num_stages, num_chunks, num_microbatches
    w = D - rank - 1 if v == 1 else (D - rank - 1) * 2 + (v - 1) * D
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
    _check_sizes(num_stages, num_chunks, num_microbatches)
    if num_chunks != 1:
        raise ConfigError(f"1f1b needs num_chunks == 1, got num_chunks={num_chunks} "
                          "(use interleaved-1f1b)")
    D, M = num_stages, num_microbatches
    order = _interleaved_order(D, 1, M, forward=True)
    ops = {r: _one_f_one_b_ops(order, order, _warmup(r, D, 1, M)) + [Step(None)] for r in range(D)}
    return Schedule("1f1b", D, 1, M, ops)


def _check_interleaved(num_stages: int, num_chunks: int, num_microbatches: int, name: str) -> None:
    if num_chunks > 1 and num_microbatches % num_stages != 0:
        raise ConfigError(f"{name} with num_chunks > 1 needs num_microbatches % num_stages == 0, "
                          f"got M={num_microbatches}, D={num_stages}")


def interleaved_one_f_one_b(num_stages: int, num_chunks: int, num_microbatches: int) -> Schedule:
    """Megatron's interleaved 1F1B: forwards and backwards in `_interleaved_order`, warm-up
    `_warmup`, steady 1F1B, cool-down, Step. Works for D = 2 (Megatron forbids it) and for v = 1,
    where it equals `one_f_one_b`.

    Unlike Megatron we do not switch to all-forwards-then-all-backwards when M == D: with isend and a
    blocking recv the regular order cannot deadlock there either (check_schedule proves it).
    """
    _check_sizes(num_stages, num_chunks, num_microbatches)
    _check_interleaved(num_stages, num_chunks, num_microbatches, "interleaved-1f1b")
    D, v, M = num_stages, num_chunks, num_microbatches
    forwards = _interleaved_order(D, v, M, forward=True)
    backwards = _interleaved_order(D, v, M, forward=False)
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
    _check_sizes(num_stages, num_chunks, num_microbatches)
    if not isinstance(update_interval, int) or update_interval < 1:
        raise ConfigError(f"update_interval must be an integer >= 1, got {update_interval!r}")
    _check_interleaved(num_stages, num_chunks, num_microbatches, "async 1f1b")
    D, v, M = num_stages, num_chunks, num_microbatches
    forwards = _interleaved_order(D, v, M, forward=True)
    backwards = _interleaved_order(D, v, M, forward=False)
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
    # zero_bubble.py builds on this module's ops and helpers, so its table is imported here, late.
    from megatron_po.pipeline.zero_bubble import ZB_SCHEDULES
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
    num_messages: int  # p2p sends implied by the ops


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
    num_messages = sum(comm_of(schedule.ops[r][i], r, D, v, schedule.placement)[1] is not None for r, i in order)
    per_rank = {r: len(ops) for r, ops in schedule.ops.items()}
    return ScheduleStats(peak, per_rank, sum(per_rank.values()), num_messages)


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
