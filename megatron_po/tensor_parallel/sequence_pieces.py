"""A sequence held in pieces by the ranks of a layer, gathered whole and cut back to this rank's tokens.

Context parallelism (data/context_split.py) gives CP rank i chunks i and 2·CP−1−i of every sequence;
sequence parallelism (mappings.py) gives each TP rank a contiguous slice of a CP rank's tokens. Three places need
the whole sequence in its order on every rank: the all-gather form of context-parallel attention (keys and
values, models/context_parallel_attention.py), the MoE router (its logits, models/moe/router.py: the capacity,
the per-sequence loss and the ties see the sequence as one process does) and multi-token prediction (the tokens,
labels and loss mask it rolls, models/mtp.py, then `context_parallel_rows`). One autograd function serves all:

    gather_from_context_parallel_region(x, dim, sum_grads)
        forward: all-gather over the CP group, each rank's chunks put in their places along `dim`
        backward: this rank's rows of the gradient, summed over the CP ranks (`sum_grads`: each rank's
        gradient of the whole is a partial one, as the keys its queries saw) or its own rows only (each
        rank computed the same function of the whole, as the router's losses)

and for the router, which routes the whole micro-batch and then keeps its own tokens:

    gather_whole_sequence(x, sequence_parallel)   the SP gather, then the CP one (dim 0, gradients: own rows)
    this_rank_tokens(x, sequence_parallel)         the inverse cut of a whole-sequence [s, ...] tensor
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.data.context_split import token_indices
from megatron_po.tensor_parallel.mappings import (_all_gather_single, _reduce_scatter_single,
                                                  gather_from_sequence_parallel_region)


def _cp() -> int:
    return ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1


class _GatherFromContextParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, sum_grads: bool) -> torch.Tensor:
        cp, group = ps.get_context_parallel_world_size(), ps.get_context_parallel_group()
        local = x.movedim(dim, 0).contiguous()
        parts = local.new_empty((cp * local.shape[0],) + tuple(local.shape[1:]))
        _all_gather_single(parts, local, group)
        s = parts.shape[0]
        order = torch.cat([token_indices(s, cp, r, x.device) for r in range(cp)])
        whole = torch.empty_like(parts)
        whole[order] = parts
        ctx.dim, ctx.sum_grads = dim, sum_grads
        return whole.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp, rank, group = (ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(),
                           ps.get_context_parallel_group())
        grad = grad.movedim(ctx.dim, 0)
        s = grad.shape[0]
        if not ctx.sum_grads:
            return grad.index_select(0, token_indices(s, cp, rank, grad.device)).movedim(0, ctx.dim), None, None
        shares = torch.stack([grad.index_select(0, token_indices(s, cp, r, grad.device)) for r in range(cp)])
        if ps.reduce_scatter_grads(group):
            mine = torch.empty_like(shares[0])
            _reduce_scatter_single(mine, shares, group)
        else:  # gloo: an all-reduce, then this rank's share (parallel_state.reduce_scatter_grads)
            dist.all_reduce(shares, group=group)
            mine = shares[rank]
        return mine.movedim(0, ctx.dim), None, None


def gather_from_context_parallel_region(x: torch.Tensor, dim: int = 0, sum_grads: bool = False) -> torch.Tensor:
    """This CP rank's chunks of a sequence along `dim` -> the whole sequence in its order (module docstring)."""
    return _GatherFromContextParallelRegion.apply(x, dim, sum_grads) if _cp() > 1 else x


def context_parallel_rows(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """This CP rank's chunks of a whole sequence along `dim` (autograd: the other rows get no gradient)."""
    cp = _cp()
    if cp == 1:
        return x
    return x.index_select(dim, token_indices(x.shape[dim], cp, ps.get_context_parallel_rank(), x.device))


def gather_whole_sequence(x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """[s_local, ...] of this rank's tokens -> [s, ...] of the whole sequence, in order (over TP with
    `sequence_parallel`, then over CP); the backward keeps this rank's rows of the gradient."""
    if sequence_parallel:
        x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
    return gather_from_context_parallel_region(x, 0, sum_grads=False)


def this_rank_tokens(x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """The rows of a whole-sequence [s, ...] tensor that this rank holds: its CP chunks, then its TP slice of them
    with `sequence_parallel` (the inverse of `gather_whole_sequence`)."""
    x = context_parallel_rows(x, 0)
    if sequence_parallel:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        s_local = x.shape[0] // tp
        x = x[rank * s_local:(rank + 1) * s_local]
    return x
