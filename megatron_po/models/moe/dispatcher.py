"""Token dispatchers: the routed tokens to the ranks holding their experts, grouped by expert, and the experts'
outputs back to their tokens, weighted by the routing weights (Megatron-core's token dispatchers).

A rank's tokens first go in expert order (`permute`: expert-major, token order within an expert); `combine`
adds every expert's weighted output back into its token's row in that same order, so a token's outputs are
summed in the order of its experts on every layout.

- alltoall (--moe-token-dispatcher-type alltoall): `all_to_all_single` over the expert-parallel group sends each
  expert's tokens to the EP rank that holds it (the split sizes come from an exchange of the per-expert
  counts); with expert TP > 1 the ETP ranks of one EP rank then gather each other's received tokens (each holds
  a slice of every expert's ffn), and on the way back their partial outputs are summed (a reduce-scatter of
  unequal pieces). The received chunks [ETP rank][source EP rank][local expert] are reordered expert-major for
  the experts and back again after them.
- allgather (the default, as in Megatron): every rank of the dispatch group (ETP x EP) gathers all tokens, routing
  weights and maps of the group, runs its local experts on the tokens routed to them, and a reduce-scatter sums
  every expert's (partial) output into the rank that holds the token.

Every collective with a gradient is `all_to_all` below (unequal pieces, its backward the same exchange the
other way), so gathers and reduce-scatters of unequal sizes are one primitive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.models.moe.layout import local_experts


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Rows `in_splits[j]` of x to rank j of `group`; `out_splits[j]` rows from rank j (autograd)."""
    return _AllToAll.apply(x, group, list(out_splits), list(in_splits))


def gather_rows(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Every rank's x (rank j's has `sizes[j]` rows), concatenated in rank order, on every rank of `group`."""
    if len(sizes) == 1:
        return x
    return all_to_all(torch.cat([x] * len(sizes)), group, sizes, [x.shape[0]] * len(sizes))


def reduce_scatter_rows(x: torch.Tensor, group, sizes: list[int], rank: int) -> torch.Tensor:
    """x holds every rank's rows (rank j's `sizes[j]`) in rank order: the sum over `group` of my rows."""
    if len(sizes) == 1:
        return x
    mine = sizes[rank]
    return all_to_all(x, group, [mine] * len(sizes), sizes).view(len(sizes), mine, *x.shape[1:]).sum(dim=0)


def _gather_counts(counts: torch.Tensor, group, n: int) -> torch.Tensor:
    """[n, *counts.shape]: every rank's `counts` (integers or a bool map; no gradient)."""
    if n == 1:
        return counts[None]
    sent = counts.to(torch.uint8) if counts.dtype == torch.bool else counts.contiguous()  # gloo has no bool
    out = sent.new_empty((n * sent.shape[0],) + tuple(sent.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.10
    gather(out, sent, group=group)
    return out.view((n,) + tuple(counts.shape)).to(counts.dtype)


def permute(tokens: torch.Tensor, routing_map: torch.Tensor):
    """(tokens in expert order [N, h], their token rows [N], their experts [N]) of routing_map [T, E]."""
    experts, rows = routing_map.t().nonzero(as_tuple=True)
    return tokens.index_select(0, rows), rows, experts


def combine(outputs: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum of every routed output times its weight into its token's row: [num_tokens, h], in the wider dtype of the
    two (--moe-router-dtype: the routing weights' fp32 or fp64, as Megatron's unpermute)."""
    dtype = torch.promote_types(outputs.dtype, weights.dtype)
    weighted = outputs.to(dtype) * weights.unsqueeze(-1).to(dtype)
    return weighted.new_zeros(num_tokens, outputs.shape[1]).index_add(0, rows, weighted)


@dataclass
class AllToAllContext:
    """What `AllToAllDispatcher.restore` needs of its dispatch."""

    rows: torch.Tensor  # the token row of every routed (token, expert) pair, in expert order
    weights: torch.Tensor  # their routing weights
    num_tokens: int  # this rank's tokens
    sent: list[int]  # pairs sent to each EP rank
    received: list[int]  # pairs received from each EP rank
    sizes: list[int]  # pairs each expert-TP rank of this EP rank received (gathered over expert TP)
    order: torch.Tensor | None  # the permutation that put the received chunks expert-major (None: already)


@dataclass
class AllGatherContext:
    """What `AllGatherDispatcher.restore` needs of its dispatch."""

    rows: torch.Tensor  # the gathered token row of every pair routed to a local expert, in expert order
    weights: torch.Tensor  # their routing weights
    num_gathered: int  # the tokens of the whole dispatch group
    sizes: list[int]  # each rank's tokens in the dispatch group


class AllToAllDispatcher:
    def __init__(self, num_experts: int):
        self.ep_group, self.etp_group = ps.get_expert_model_parallel_group(), ps.get_expert_tensor_parallel_group()
        self.ep, self.etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
        self.etp_rank = ps.get_expert_tensor_parallel_rank()
        self.local = local_experts(num_experts, self.ep, ps.get_expert_model_parallel_rank())

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """(expert inputs grouped by local expert, rows per local expert [local experts], AllToAllContext)."""
        x, rows, experts = permute(tokens, routing_map)
        weights = probs[rows, experts]
        counts = routing_map.sum(dim=0).view(self.ep, len(self.local))  # [destination EP rank, its expert]
        sent = counts.sum(dim=1).tolist()
        got = counts
        if self.ep > 1:
            got = torch.empty_like(counts)  # [source EP rank, my expert]
            dist.all_to_all_single(got, counts, group=self.ep_group)
            x = all_to_all(x, self.ep_group, got.sum(dim=1).tolist(), sent)
        received = got.sum(dim=1).tolist()
        chunks = _gather_counts(got, self.etp_group, self.etp)  # [ETP rank, source EP rank, my expert]
        sizes = chunks.sum(dim=(1, 2)).tolist()
        x = gather_rows(x, self.etp_group, sizes)
        order = None
        if chunks.shape[0] * chunks.shape[1] > 1 and len(self.local) > 1:  # the chunks expert-major
            expert_of_chunk = torch.arange(len(self.local), device=x.device).expand_as(chunks).reshape(-1)
            order = torch.sort(expert_of_chunk.repeat_interleave(chunks.reshape(-1)), stable=True).indices
            x = x.index_select(0, order)
        return x, chunks.sum(dim=(0, 1)), AllToAllContext(rows, weights, tokens.shape[0], sent, received, sizes, order)

    def restore(self, y: torch.Tensor, context: AllToAllContext) -> torch.Tensor:
        """The experts' outputs `y` (dispatch's order) back to their tokens, weighted and summed: [T, h]."""
        if context.order is not None:
            y = y.index_select(0, torch.argsort(context.order))
        y = reduce_scatter_rows(y, self.etp_group, context.sizes, self.etp_rank)
        if self.ep > 1:
            y = all_to_all(y, self.ep_group, context.sent, context.received)
        return combine(y, context.weights, context.rows, context.num_tokens).to(y.dtype)


class AllGatherDispatcher:
    def __init__(self, num_experts: int):
        self.group = ps.get_expert_tensor_and_model_parallel_group()
        self.size = _size(self.group)
        self.rank = dist.get_rank(self.group) if self.size > 1 else 0
        self.local = local_experts(num_experts, ps.get_expert_model_parallel_world_size(),
                                   ps.get_expert_model_parallel_rank())

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """(the group's tokens routed to my experts, grouped by local expert; rows per local expert; AllGatherContext)."""
        num_tokens = tokens.shape[0]
        sizes = [num_tokens] * self.size
        tokens, probs = gather_rows(tokens, self.group, sizes), gather_rows(probs, self.group, sizes)
        if self.size > 1:
            routing_map = _gather_counts(routing_map, self.group, self.size).reshape(-1, routing_map.shape[1])
        mine = routing_map[:, self.local.start:self.local.stop]
        x, rows, experts = permute(tokens, mine)
        weights = probs[rows, experts + self.local.start]
        return x, mine.sum(dim=0), AllGatherContext(rows, weights, tokens.shape[0], sizes)

    def restore(self, y: torch.Tensor, context: AllGatherContext) -> torch.Tensor:
        combined = combine(y, context.weights, context.rows, context.num_gathered)
        return reduce_scatter_rows(combined, self.group, context.sizes, self.rank).to(y.dtype)


# Megatron's flex dispatcher (DeepEP's kernels, --moe-enable-deepep) moves the same tokens to the same experts as its
# alltoall: here it is the alltoall one (a start-up line says so, rules.py NO_OP_SWITCHES).
DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher, "flex": AllToAllDispatcher}
