"""Tensor-parallel layers: column/row-parallel linear and vocab-parallel embedding (Megatron's).

A transformer MLP is  Y = gelu(X A) B.  Split A by output columns (ColumnParallelLinear) and B by input
rows (RowParallelLinear): each TP rank computes gelu(X A_i) B_i on its own, and one all-reduce sums
the partial outputs. Attention splits the same way by heads. Weights are stored as F.linear wants them,
[out, in], so "column-parallel" splits weight dim 0 and "row-parallel" splits weight dim 1.

Activations are [seq, batch, hidden]. With sequence parallelism the activations outside TP regions are
also split along seq: the column-parallel layer all-gathers its input along seq, and the row-parallel
layer reduce-scatters its output along seq instead of all-reducing it.

Both linear layers return `(output, output_bias)` like Megatron: `output_bias` is None unless
`skip_bias_add=True`, in which case the bias is returned unadded so the caller can fuse it (bias+gelu,
bias+dropout+residual).

Initialization does not depend on the TP size: every rank draws the FULL master weight with
`init_method` from the default generator (identical across TP ranks, see random.py) and keeps its
slice, so a TP=2 model built from the same seed holds exactly the slices of the TP=1 model's weights.

Parameter attributes (read by grad-norm, optimizer, DDP and checkpoint code):
  tensor_model_parallel (bool)  this parameter is a slice; False: replicated on every TP rank, so
                                count it once in norms (see `param_is_not_tensor_parallel_duplicate`).
  partition_dim (int)           the dim it is sliced along (-1 if replicated).
  partition_stride (int)        1 = contiguous slices; s > 1 = the full dim is cut in world*s chunks and
                                rank r holds chunks r, r+world, ... (see `shard_tensor`).
  sequence_parallel (bool)      replicated parameter whose gradient is PARTIAL under sequence
                                parallelism (each rank saw only its part of the sequence): the grad
                                must be all-reduced over the TP group before the optimizer step. Set
                                here on the row-parallel bias; models must set it on LayerNorm weights
                                and biases in sequence-parallel regions. Read it with
                                `getattr(p, "sequence_parallel", False)`.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_po.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from megatron_po.tensor_parallel import weight_grads
from megatron_po.tensor_parallel.fp8 import fp8_linear
from megatron_po.tensor_parallel.graph_breaks import runs_eagerly
from megatron_po.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    divide,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

# --------------------------------------------------------------------------------------------------
# Parameter attributes and sharding helpers
# --------------------------------------------------------------------------------------------------

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    for name, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    for name in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """True if this rank should count `param` in a norm over the TP group: slices always, replicated
    parameters only on TP rank 0."""
    return getattr(param, "tensor_model_parallel", False) or get_tensor_model_parallel_rank() == 0


def shard_tensor(full: torch.Tensor, dim: int, rank: int, world_size: int, stride: int = 1) -> torch.Tensor:
    """Rank `rank`'s slice of `full` along `dim` (the layout the layers use for their parameters)."""
    chunk = divide(full.size(dim), world_size * stride)
    pieces = torch.split(full, chunk, dim=dim)
    return torch.cat(pieces[rank::world_size], dim=dim).contiguous()


def gather_tensor(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of `shard_tensor`: the full tensor from every rank's slice, listed by TP rank."""
    world_size = len(shards)
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    # Chunk k of the full tensor is piece k // world_size of rank k % world_size.
    return torch.cat([pieces[k % world_size][k // world_size] for k in range(world_size * stride)], dim=dim)


def init_method_normal(sigma: float):
    """N(0, sigma) initialization (Megatron's default with sigma = 0.02)."""
    def init_(tensor):
        return nn.init.normal_(tensor, mean=0.0, std=sigma)
    return init_


def _initialize_affine_weight_cpu(weight: torch.Tensor, full_shape: tuple[int, int], partition_dim: int,
                                  init_method, stride: int = 1) -> None:
    """Draw the full master weight on the CPU default generator and copy this rank's slice into
    `weight`. Every TP rank draws the same numbers, so the result does not depend on the TP size."""
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)
    master_weight = torch.empty(full_shape, dtype=torch.float32)
    init_method(master_weight)
    my_slice = shard_tensor(master_weight, partition_dim, get_tensor_model_parallel_rank(),
                            get_tensor_model_parallel_world_size(), stride)
    with torch.no_grad():
        weight.copy_(my_slice)


# --------------------------------------------------------------------------------------------------
# Linear layers
# --------------------------------------------------------------------------------------------------


class _Linear(torch.autograd.Function):
    """F.linear whose backward reads the weight through the Parameter itself.

    F.linear's own autograd saves `weight.t()`, a view of the storage the forward read. Saving the leaf
    Parameter instead lets a weight policy point the parameter at other storage for a forward (PipeOptim's
    predicted weights, `pipeline/policies.py`) and back before the backward, which then reads the live
    weights; with the storage unchanged the results are F.linear's, bit for bit (tests/test_layers.py)."""

    @staticmethod
    def forward(ctx, input_, weight, bias, dtype=None):
        ctx.save_for_backward(input_, weight)
        ctx.has_bias = bias is not None
        # The deferred W op (weight_grads.py) accumulates into these very tensors: a saved tensor unpacked
        # under activation recomputation is an alias with its own gradient, not the Parameter.
        ctx.weight, ctx.bias = weight, bias
        if dtype is not None:  # the GEMM in `dtype` (the MoE router's --moe-router-dtype)
            input_, weight = input_.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        return F.linear(input_, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        # In the forward GEMM's dtype (grad_output's); each gradient goes back in its tensor's dtype.
        grad_input = (grad_output.matmul(weight.to(grad_output.dtype)).to(input_.dtype)
                      if ctx.needs_input_grad[0] else None)
        need_w, need_b = ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
        bias = ctx.bias if need_b else None
        # Zero-bubble B op: leave the weight gradient to the W op (weight_grads.py). Only for leaf
        # parameters, whose gradient can be accumulated on its own once this graph is freed.
        if (weight_grads.deferring() and need_w and ctx.weight.grad_fn is None
                and (bias is None or bias.grad_fn is None)):
            weight_grads.defer(functools.partial(_Linear._weight_grads, input_, grad_output, ctx.weight, bias))
            return grad_input, None, None, None
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_weight = _weight_grad(grad_2d, input_, weight) if need_w else None
        grad_bias = grad_2d.sum(0).to(bias.dtype) if need_b else None
        return grad_input, grad_weight, grad_bias, None

    @staticmethod
    def _weight_grads(input_, grad_output, weight, bias):
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        out = []
        if weight is not None:
            out.append((weight, _weight_grad(grad_2d, input_, weight)))
        if bias is not None:
            out.append((bias, grad_2d.sum(0).to(bias.dtype)))
        return out


def _weight_grad(grad_2d: torch.Tensor, input_: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad_2d.t().mm(input_.reshape(-1, input_.shape[-1]).to(grad_2d.dtype)).to(weight.dtype)


# Zero-bubble's B op decides at backward time to defer the weight gradient (weight_grads.py); a compiled
# backward is fixed when traced, so under a split backward the GEMM of a compiled layer runs outside its graph.
@runs_eagerly
def _linear_outside_compiled_graph(input_, weight, bias):
    return _Linear.apply(input_, weight, bias)


@runs_eagerly
def _fp8_linear_outside_compiled_graph(input_, weight, bias, fp8):
    return fp8_linear(input_, weight, bias, fp8)


def linear(input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           in_compiled_graph: bool = True, fp8=None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`_Linear`. Traced by torch.compile (a compiled layer, models/compiled_layers.py) it is F.linear, whose
    AOTAutograd backward reads the weight through the Parameter too (a graph input is saved as itself), so
    the same weight policies work (tests/test_compiled_layers.py checks it); `in_compiled_graph=False` (split
    backward) leaves the graph for `_Linear`, whose B op can defer the weight gradient. `fp8` (an FP8Gemm,
    tensor_parallel/fp8.py): the same, its GEMMs in FP8. `dtype`: the GEMM (and its output) in that dtype,
    eager only (the MoE router, which runs outside compiled graphs)."""
    if dtype is not None:
        return _Linear.apply(input_, weight, bias, dtype)
    if fp8 is not None:
        if torch.compiler.is_compiling() and not in_compiled_graph:
            return _fp8_linear_outside_compiled_graph(input_, weight, bias, fp8)
        return fp8_linear(input_, weight, bias, fp8)
    if torch.compiler.is_compiling():
        if in_compiled_graph:
            return F.linear(input_, weight, bias)
        return _linear_outside_compiled_graph(input_, weight, bias)
    return _Linear.apply(input_, weight, bias)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A ([output_size, input_size]) split along output_size over TP ranks.

    input:  [s, b, input_size], replicated on TP ranks (or [s/tp, b, input_size] with sequence_parallel)
    output: [s, b, output_size/tp] on each rank, or [s, b, output_size] if gather_output.

    `skip_weight_param_allocation=True` creates no weight; `forward(x, weight=...)` then uses the given
    [output_size/tp, input_size] slice (an output layer tied to the vocab-parallel word embedding).
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, gather_output: bool = False,
                 init_method=None, stride: int = 1, sequence_parallel: bool = False,
                 skip_bias_add: bool = False, skip_weight_param_allocation: bool = False):
        super().__init__()
        if gather_output and sequence_parallel:
            # The output would be gathered along hidden while the rest of the block expects seq-split.
            raise ValueError("ColumnParallelLinear: gather_output is incompatible with sequence_parallel")
        self.input_size, self.output_size = input_size, output_size
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.skip_bias_add = skip_bias_add
        self.gemm_in_compiled_graph = True  # False: a compiled layer runs the GEMM eagerly (see `linear`)
        self.fp8 = None  # an FP8Gemm: the local GEMM in FP8 (tensor_parallel/fp8.py; set by models/fp8.py)
        world_size = get_tensor_model_parallel_world_size()
        self.output_size_per_partition = divide(output_size, world_size)
        init_method = init_method or init_method_normal(0.02)

        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size))
            _initialize_affine_weight_cpu(self.weight, (output_size, input_size), 0, init_method, stride)
            self.weight.sequence_parallel = False
        if bias:
            # Each rank's bias slice sees the full (gathered) sequence: its grad is complete.
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition))
            set_tensor_model_parallel_attributes(self.bias, is_parallel=True, dim=0, stride=stride)
            self.bias.sequence_parallel = False
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None):
        if weight is None:
            if self.weight is None:
                raise RuntimeError("ColumnParallelLinear built with skip_weight_param_allocation needs `weight`")
            weight = self.weight
        bias = None if self.skip_bias_add else self.bias
        output_parallel = linear(self.parallel_input(input_), weight, bias, self.gemm_in_compiled_graph, self.fp8)
        output = gather_from_tensor_model_parallel_region(output_parallel) if self.gather_output else output_parallel
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias

    def parallel_input(self, input_: torch.Tensor) -> torch.Tensor:
        """The input every TP rank multiplies by its weight slice (also the chunked output loss's,
        output_cross_entropy.py)."""
        if self.sequence_parallel:
            # [s/tp, b, h] -> [s, b, h]; backward reduce-scatters the partial input grads.
            return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True)
        # Replicated input; backward all-reduces the partial input grads.
        return copy_to_tensor_model_parallel_region(input_)

    def extra_repr(self):
        return (f"input_size={self.input_size}, output_size={self.output_size} "
                f"(per partition {self.output_size_per_partition}), gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A ([output_size, input_size]) split along input_size over TP ranks.

    input:  [s, b, input_size/tp] (input_is_parallel) or [s, b, input_size] replicated (then scattered).
    output: [s, b, output_size] replicated, or [s/tp, b, output_size] with sequence_parallel.

    The bias is replicated and added after the reduction (adding it on each rank would count it tp
    times). Under sequence parallelism each rank's bias grad covers only its sequence slice, so the bias
    is marked `sequence_parallel=True` (all-reduce its grad over TP).
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, input_is_parallel: bool = True,
                 init_method=None, stride: int = 1, sequence_parallel: bool = False, skip_bias_add: bool = False):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel requires input_is_parallel=True")
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.skip_bias_add = skip_bias_add
        self.gemm_in_compiled_graph = True  # False: a compiled layer runs the GEMM eagerly (see `linear`)
        self.fp8 = None  # an FP8Gemm: the local GEMM in FP8 (tensor_parallel/fp8.py; set by models/fp8.py)
        world_size = get_tensor_model_parallel_world_size()
        self.input_size_per_partition = divide(input_size, world_size)
        init_method = init_method or init_method_normal(0.02)

        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition))
        _initialize_affine_weight_cpu(self.weight, (output_size, input_size), 1, init_method, stride)
        self.weight.sequence_parallel = False
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size))
            set_tensor_model_parallel_attributes(self.bias, is_parallel=False, dim=-1, stride=1)
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_)
        # Partial sums of the output, reduced below.
        output_parallel = linear(input_parallel, self.weight, None, self.gemm_in_compiled_graph, self.fp8)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel)
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel)
        if self.skip_bias_add:
            return output, self.bias
        if self.bias is not None:
            output = output + self.bias
        return output, None

    def extra_repr(self):
        return (f"input_size={self.input_size} (per partition {self.input_size_per_partition}), "
                f"output_size={self.output_size}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class ReplicatedLinear(nn.Module):
    """Y = X A^T with A ([output_size, input_size]) whole on every TP rank, no bias (Megatron's "duplicated" linear:
    multi-latent attention's down-projections, models/mla.py).

    input:  this rank's tokens, [s, b, input_size] (replicated) or [s/tp, b, input_size] with sequence_parallel.
    output: the same tokens, [s or s/tp, b, output_size].

    Every TP rank draws the same weight. Without sequence parallelism the ranks multiply the same tokens and, the
    output's gradient being whole there (the consumer sums it over TP), compute the same gradient; with it each
    rank's gradient covers its own tokens: `sequence_parallel=True`, summed over TP before the step."""

    def __init__(self, input_size: int, output_size: int, *, init_method=None, sequence_parallel: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.gemm_in_compiled_graph = True  # False: a compiled layer runs the GEMM eagerly (see `linear`)
        self.fp8 = None  # an FP8Gemm: the GEMM in FP8 (tensor_parallel/fp8.py; set by models/fp8.py)
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        (init_method or init_method_normal(0.02))(self.weight.data)
        set_tensor_model_parallel_attributes(self.weight, is_parallel=False, dim=-1, stride=1)
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        return linear(input_, self.weight, None, self.gemm_in_compiled_graph, self.fp8)

    def extra_repr(self):
        return f"input_size={self.input_size}, output_size={self.output_size} (replicated)"


# --------------------------------------------------------------------------------------------------
# Embedding
# --------------------------------------------------------------------------------------------------


def pad_vocab_size(orig_vocab_size: int, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Megatron's _vocab_size_with_padding: round the vocab up to a multiple of divisible_by * tp, so
    every TP rank holds an equal, GEMM-friendly slice. The padded ids are never produced by the tokenizer."""
    multiple = make_vocab_size_divisible_by * tp_size
    return int(math.ceil(orig_vocab_size / multiple)) * multiple


class VocabUtility:
    """The contiguous range of vocab ids [first, last) owned by a TP rank."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int, world_size: int):
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int):
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)


class VocabParallelEmbedding(nn.Module):
    """Embedding table with its rows (the vocab) split over TP ranks.

    Each rank looks up the ids it owns, writes zeros for the others, and the TP all-reduce fills in the
    rest: the sum has exactly one non-zero contribution per token.

    input:  ids [b, s] (any shape); output: [*ids.shape, embedding_dim], replicated on TP ranks.
    With `reduce_scatter_embeddings=True` (Megatron-core's flag, for sequence parallelism) the output is
    instead transposed to [s, b, h] and reduce-scattered along s: [s/tp, b, h], saving the all-reduce
    plus the later scatter. Without the flag, a sequence-parallel caller transposes to [s, b, h] and
    calls `scatter_to_sequence_parallel_region` itself.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method=None,
                 reduce_scatter_embeddings: bool = False):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.tensor_model_parallel_size = get_tensor_model_parallel_world_size()
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, get_tensor_model_parallel_rank(), self.tensor_model_parallel_size)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        init_method = init_method or init_method_normal(0.02)

        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))
        _initialize_affine_weight_cpu(self.weight, (num_embeddings, embedding_dim), 0, init_method)
        self.weight.sequence_parallel = False

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tensor_model_parallel_size > 1:
            input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            # Ids owned by other ranks look up row 0 (any valid row) and are zeroed below.
            masked_input = (input_ - self.vocab_start_index).masked_fill(input_mask, 0)
            output_parallel = F.embedding(masked_input, self.weight)
            output_parallel = output_parallel.masked_fill(input_mask.unsqueeze(-1), 0.0)
        else:
            output_parallel = F.embedding(input_, self.weight)
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output_parallel)
        return reduce_from_tensor_model_parallel_region(output_parallel)

    def extra_repr(self):
        return (f"num_embeddings={self.num_embeddings} (per partition {self.num_embeddings_per_partition}), "
                f"embedding_dim={self.embedding_dim}")
