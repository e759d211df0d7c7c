"""Communication at the borders of tensor-parallel regions, as autograd functions.

Each mapping is a pair (forward collective, backward collective) over the tensor-parallel (TP) group,
with Megatron's names. The pairs are adjoint: if the forward sums, the backward copies, and if the
forward gathers, the backward splits. All of them are no-ops when the TP size is 1, so a model built
from them runs unchanged in a single process.

Two families:
  * tensor-parallel region, split/gathered along the LAST dim (hidden/vocab columns):
      copy_to_...           fwd identity        bwd all-reduce   (replicated input enters a TP region)
      reduce_from_...       fwd all-reduce      bwd identity     (partial sums leave a TP region)
      scatter_to_...        fwd split last      bwd all-gather
      gather_from_...       fwd all-gather last bwd split
  * sequence-parallel region, split/gathered along the FIRST dim (activations are [seq, batch, hidden]):
      scatter_to_sequence_parallel_region          fwd split dim 0       bwd all-gather dim 0
      gather_from_sequence_parallel_region         fwd all-gather dim 0  bwd reduce-scatter (or split)
      reduce_scatter_to_sequence_parallel_region   fwd reduce-scatter 0  bwd all-gather dim 0

Collectives never modify their input in place: the forward input of a mapping may be a tensor that
autograd saved for another op, so we write into fresh buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_po.errors import ConfigError
from megatron_po.tensor_parallel.graph_breaks import runs_eagerly
from megatron_po.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)


def divide(numerator: int, denominator: int) -> int:
    """numerator / denominator, refusing a remainder (a size that does not split over TP ranks)."""
    if numerator % denominator != 0:
        raise ConfigError(f"{numerator} is not divisible by {denominator} "
                          f"(a layer size must split evenly over --tensor-model-parallel-size ranks)")
    return numerator // denominator


# torch >= 2.10 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn); the
# single-tensor collectives work on gloo and nccl alike. Looked up at call time so tests can wrap them.
def _all_gather_single(output, input_, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input_, group=group)


def _reduce_scatter_single(output, input_, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input_, group=group)


# --------------------------------------------------------------------------------------------------
# The raw collectives (no autograd)
# --------------------------------------------------------------------------------------------------


def _reduce(input_: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) over the TP group, into a new tensor."""
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    output = input_.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(output, group=get_tensor_model_parallel_group())
    return output


def _split_along_last_dim(input_: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of the last dim."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_
    chunk = divide(input_.size(-1), world_size)
    rank = get_tensor_model_parallel_rank()
    return input_[..., rank * chunk:(rank + 1) * chunk].contiguous()


def _split_along_first_dim(input_: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of dim 0 (the sequence dim)."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_
    chunk = divide(input_.size(0), world_size)
    rank = get_tensor_model_parallel_rank()
    return input_[rank * chunk:(rank + 1) * chunk].contiguous()


def _gather_along_first_dim(input_: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0, in TP-rank order."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_
    output = input_.new_empty((input_.size(0) * world_size,) + tuple(input_.shape[1:]))
    _all_gather_single(output, input_.contiguous(), get_tensor_model_parallel_group())
    return output


def _gather_along_last_dim(input_: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's tensor along the last dim, in TP-rank order."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_
    # The collective concatenates along dim 0; re-concatenate the pieces along the last dim.
    stacked = _gather_along_first_dim(input_)
    return torch.cat(stacked.chunk(world_size, dim=0), dim=-1).contiguous()


def _reduce_scatter_along_first_dim(input_: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group, and keep this rank's slice of dim 0."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_
    output = input_.new_empty((divide(input_.size(0), world_size),) + tuple(input_.shape[1:]))
    _reduce_scatter_single(output, input_.contiguous(), get_tensor_model_parallel_group())
    return output


# --------------------------------------------------------------------------------------------------
# Autograd functions
# --------------------------------------------------------------------------------------------------


class _CopyToModelParallelRegion(torch.autograd.Function):
    """Replicated input enters a TP region: each rank's grad is partial, so the backward sums them."""

    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """Partial sums leave a TP region: the output is replicated, so is its grad."""

    @staticmethod
    def forward(ctx, input_):
        return _reduce(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _split_along_last_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _gather_along_last_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output)


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _split_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence. If the gathered tensor feeds a TP-split computation (a column-parallel
    linear), each rank's grad is a partial sum over its columns: reduce-scatter. If it feeds a
    replicated computation, every rank already holds the full grad: just split."""

    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad=True):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad_output), None
        return _split_along_first_dim(grad_output), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce_scatter_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output)


# --------------------------------------------------------------------------------------------------
# Public wrappers (Megatron's names)
# --------------------------------------------------------------------------------------------------


@runs_eagerly
def _apply_outside_compiled_graph(function, *args):
    return function.apply(*args)


def _apply(function, *args):
    """`function.apply(*args)`; in a compiled layer (--torch-compile) with TP > 1, between two graphs, its
    collectives eager in both directions. Traced into the graph, torch 2.11 computed wrong gradients through
    the backward's all-reduce (TP 2: the loss off by 1e-3 after one update, then diverging; torch 2.13 was
    right). With TP = 1 the mappings are identities and stay in the graph."""
    if torch.compiler.is_compiling() and get_tensor_model_parallel_world_size() > 1:
        return _apply_outside_compiled_graph(function, *args)
    return function.apply(*args)


def copy_to_tensor_model_parallel_region(input_):
    return _apply(_CopyToModelParallelRegion, input_)


def reduce_from_tensor_model_parallel_region(input_):
    return _apply(_ReduceFromModelParallelRegion, input_)


def scatter_to_tensor_model_parallel_region(input_):
    return _apply(_ScatterToModelParallelRegion, input_)


def gather_from_tensor_model_parallel_region(input_):
    return _apply(_GatherFromModelParallelRegion, input_)


def scatter_to_sequence_parallel_region(input_):
    return _apply(_ScatterToSequenceParallelRegion, input_)


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True):
    return _apply(_GatherFromSequenceParallelRegion, input_, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_):
    return _apply(_ReduceScatterToSequenceParallelRegion, input_)
