"""The vocabulary of pipeline schedules (schedules.py, zero_bubble.py): the ops, the Schedule that holds
them, virtual stages and the communication an op implies, and the size checks and micro-batch order the
builders share.

Communication is implied by the ops, never listed: `Forward(mb, c)` on rank r receives the activation
of virtual stage vs-1 (unless vs is the first) and sends one to vs+1 (unless vs is the last);
`Backward(mb, c)` receives the gradient from vs+1 (unless vs holds the loss) and sends one to vs-1
(unless vs is the first). Zero-bubble schedules split it: `BackwardInput(mb, c)` communicates exactly as
`Backward` and computes the gradient w.r.t. the stage input; `BackwardWeight(mb, c)` (later, no
communication) computes the weight gradients from what BackwardInput left.

It sits below both builder modules so that schedules.py can list zero_bubble.py's schedules in
`build_schedule` without an import circle (tests/test_structure.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

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
# Shared by the builders: size checks, the interleaved micro-batch order.
# --------------------------------------------------------------------------------------------------


def check_sizes(num_stages: int, num_chunks: int, num_microbatches: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_chunks", num_chunks),
                        ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


def check_stream_interleaved(num_stages: int, num_chunks: int, num_microbatches: int, name: str) -> None:
    """The asynchronous stream keeps M % D == 0 with v > 1: its segments must cut the endless stream's
    groups of D micro-batches (`microbatch_groups`) where they end, or a segment's drain would reorder its
    last micro-batches and change the steps between their forward and backward (their staleness)."""
    if num_chunks > 1 and num_microbatches % num_stages != 0:
        raise ConfigError(f"{name} with num_chunks > 1 needs num_microbatches % num_stages == 0 (a segment must "
                          f"end where the stream's groups of D micro-batches end), got M={num_microbatches}, "
                          f"D={num_stages}")


def microbatch_groups(num_stages: int, num_microbatches: int) -> list[int]:
    """Sizes of the micro-batch groups an interleaved schedule walks through all its chunks in turn.

    max(1, M // D) groups, as equal as possible (the larger first): every group holds at least D
    micro-batches when M >= D, and all M when M < D. Megatron-core's rule is the same in spirit (its
    `microbatch_group_size_per_vp_stage` N lies in [D, M] and a final group shorter than D is refused:
    that group's micro-batches would wait on the round trip, and with our warm-up the checker finds
    deadlocks, e.g. D=8, v=2, M=10 in groups of 8 and 2). torch's ScheduleInterleaved1F1B takes the same
    max(1, M // D) rounds but needs them equal. M < D, which Megatron refuses, is one group: a blocking
    receive with isend sends cannot deadlock there (check_schedule proves it for D <= 8).
    """
    rounds = max(1, num_microbatches // num_stages)
    size, larger = divmod(num_microbatches, rounds)
    return [size + (g < larger) for g in range(rounds)]


def interleaved_order(num_stages: int, num_chunks: int, num_microbatches: int, forward: bool
                       ) -> list[tuple[int, int]]:
    """(microbatch, chunk) pairs in the order every rank runs its forwards (or backwards).

    Megatron-core's schedule table: micro-batches in groups (`microbatch_groups`); a group runs through
    chunk 0, then chunk 1, ...; backwards mirror the chunk (v-1-c) so the last virtual stage's backward
    comes first. With M % D == 0 the groups are Megatron's default groups of D; with v = 1 this is just
    micro-batches 0..M-1.
    """
    v = num_chunks
    order = []
    first = 0
    for size in microbatch_groups(num_stages, num_microbatches):
        for c in range(v):
            order += [(mb, c if forward else v - 1 - c) for mb in range(first, first + size)]
        first += size
    return order
