"""Muon over data-parallel ranks: each whole matrix is orthogonalised by one DP rank, its owner.

Ownership (`assign_owners`): the matrices, largest Newton-Schulz cost first, each to the DP rank with the
least cost so far (ties: the lower rank), so every rank runs about 1/DP of the Newton-Schulz FLOPs.
(Megatron's layer-wise optimizer deals parameters sorted by size to the ranks in a ping-pong order;
largest-first onto the least loaded rank balances at least as well.) Under the distributed optimizer a
matrix goes to the rank holding most of it instead, as long as that rank stays within 10 % of the fair
share: a matrix inside one rank's range then moves no byte. Computed from shapes and the bucket layout
only, identically on every rank.

Moving data, per step and Muon param group:
- replicated state (plain or mixed-precision optimizer: every DP rank holds the whole U of every matrix):
  `owners_to_all`: each owner packs the O of its matrices, and ONE all-gather over DP hands every rank
  every O (padded to the largest rank's share);
- sharded state (the distributed optimizer: rank r holds contiguous pieces that cut through matrices):
  `pieces_to_owners`: ONE all-to-all sends every piece of U (fp32) to its matrix's owner, which assembles
  the whole matrix; `owners_to_pieces`: ONE all-to-all sends each piece of O back to the rank holding that
  piece of U. Only the owner ever holds a whole U or O.
O travels in Newton-Schulz's output dtype (bf16 at the default precision), exactly as computed: the
scale and the cast to the parameter's dtype are applied after it arrives, so who computed an O does not
change a bit of the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_po.distributed.ddp import all_gather_single

Pieces = list[dict[int, tuple[int, int]]]  # per DP rank: {matrix index: [start, end) of the flat matrix it holds}


def assign_owners(costs: Sequence[float], world: int, held: Sequence[Sequence[int]] | None = None,
                  slack: float = 0.1) -> list[int]:
    """The DP rank that orthogonalises each matrix, largest cost first. Without `held`: onto the least
    loaded rank (ties: the lower one). With `held` (held[i][r] = elements of matrix i that rank r holds,
    the distributed optimizer's pieces): onto the rank holding most of it, where nothing has to move, unless
    that would take its load past (1 + slack) x the fair share; then onto the least loaded rank."""
    loads, owners = [0.0] * world, [0] * len(costs)
    fair = (1.0 + slack) * sum(costs) / world
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        if held is not None:
            holder = max(range(world), key=lambda r: (held[i][r], -r))
            if loads[holder] + costs[i] <= fair:
                rank = holder
        owners[i] = rank
        loads[rank] += costs[i]
    return owners


def owners_to_all(results: dict[int, Tensor], owners: list[int], numels: list[int], group,
                  dtype: torch.dtype, device) -> list[Tensor]:
    """Replicated state: every matrix's flat O on every rank, from the O of the matrices this rank owns
    (`results`, {index: tensor}); one all-gather of each rank's packed share."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shares = [[i for i in range(len(owners)) if owners[i] == r] for r in range(world)]
    width = max(sum(numels[i] for i in share) for share in shares)
    send = torch.zeros(width, dtype=dtype, device=device)
    offset = 0
    for i in shares[rank]:
        send[offset:offset + numels[i]].copy_(results[i].reshape(-1))
        offset += numels[i]
    received = torch.empty(world * width, dtype=dtype, device=device)
    all_gather_single(received, send, group, async_op=False)
    out: list[Tensor | None] = [None] * len(owners)
    for r, share in enumerate(shares):
        offset = r * width
        for i in share:
            out[i] = results[i].reshape(-1) if r == rank else received[offset:offset + numels[i]]
            offset += numels[i]
    return out


def pieces_to_owners(mine: dict[int, Tensor], pieces: Pieces, owners: list[int], numels: list[int], group,
                     device) -> dict[int, Tensor]:
    """Sharded state: the whole flat U (fp32) of each matrix this rank owns, assembled from every rank's
    pieces; `mine` holds this rank's pieces ({index: flat U piece}, the ranges `pieces[rank]` names)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    # What this rank sends to r: its pieces of r's matrices; receives from r: r's pieces of its own.
    send_order = [[i for i in sorted(pieces[rank]) if owners[i] == r] for r in range(world)]
    recv_order = [[i for i in sorted(pieces[r]) if owners[i] == rank] for r in range(world)]
    send = _pack([mine[i] for r in range(world) for i in send_order[r]], torch.float32, device)
    in_splits = [sum(_length(pieces[rank][i]) for i in send_order[r]) for r in range(world)]
    out_splits = [sum(_length(pieces[r][i]) for i in recv_order[r]) for r in range(world)]
    received = torch.empty(sum(out_splits), dtype=torch.float32, device=device)
    dist.all_to_all_single(received, send, out_splits, in_splits, group=group)
    full = {i: torch.empty(numels[i], dtype=torch.float32, device=device) for i in range(len(owners))
            if owners[i] == rank}
    offset = 0
    for r in range(world):
        for i in recv_order[r]:
            start, end = pieces[r][i]
            full[i][start:end].copy_(received[offset:offset + end - start])
            offset += end - start
    return full


def owners_to_pieces(results: dict[int, Tensor], pieces: Pieces, owners: list[int], group,
                     dtype: torch.dtype, device) -> dict[int, Tensor]:
    """Sharded state: this rank's piece of the O of every matrix it holds a piece of, from the owners'
    whole O (`results`, {index: flat O} for the matrices this rank owns)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    send_order = [[i for i in sorted(pieces[r]) if owners[i] == rank] for r in range(world)]
    recv_order = [[i for i in sorted(pieces[rank]) if owners[i] == r] for r in range(world)]
    send = _pack([results[i].reshape(-1)[slice(*pieces[r][i])] for r in range(world) for i in send_order[r]],
                 dtype, device)
    in_splits = [sum(_length(pieces[r][i]) for i in send_order[r]) for r in range(world)]
    out_splits = [sum(_length(pieces[rank][i]) for i in recv_order[r]) for r in range(world)]
    received = torch.empty(sum(out_splits), dtype=dtype, device=device)
    dist.all_to_all_single(received, send, out_splits, in_splits, group=group)
    out, offset = {}, 0
    for r in range(world):
        for i in recv_order[r]:
            n = _length(pieces[rank][i])
            out[i] = received[offset:offset + n]
            offset += n
    return out


def _length(piece: tuple[int, int]) -> int:
    return piece[1] - piece[0]


def _pack(tensors: list[Tensor], dtype: torch.dtype, device) -> Tensor:
    if not tensors:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])
