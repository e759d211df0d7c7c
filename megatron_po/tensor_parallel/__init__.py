"""Tensor parallelism (Megatron's): layers split over the TP group, the mappings between regions,
vocab-parallel cross entropy and the TP-aware random streams."""

from megatron_po.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_po.tensor_parallel.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabUtility,
    copy_tensor_model_parallel_attributes,
    gather_tensor,
    init_method_normal,
    pad_vocab_size,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    shard_tensor,
)
from megatron_po.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    divide,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_po.tensor_parallel.random import (RNGStatesTracker, checkpoint, get_rng_tracker, model_parallel_seed,
                                               on_model_parallel_rng, recompute_weights)

__all__ = [
    "ColumnParallelLinear", "ReplicatedLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabUtility",
    "copy_tensor_model_parallel_attributes", "gather_tensor", "init_method_normal", "pad_vocab_size",
    "param_is_not_tensor_parallel_duplicate", "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes", "shard_tensor",
    "copy_to_tensor_model_parallel_region", "divide", "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "vocab_parallel_cross_entropy",
    "RNGStatesTracker", "checkpoint", "get_rng_tracker", "model_parallel_seed", "on_model_parallel_rng",
    "recompute_weights",
]
