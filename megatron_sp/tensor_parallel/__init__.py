"""Tensor parallelism (Megatron-LM's column/row parallel layers, vocab-parallel embedding and
cross-entropy, sequence-parallel mappings, RNG tracker). Every function takes its group
explicitly; a None or one-rank group makes the communication the identity."""
from megatron_sp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_sp.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    full_shape,
    gather_full_like,
    sequence_parallel_linear,
    set_tp_attributes,
    shard_of_full,
)
from megatron_sp.tensor_parallel.mappings import (
    all_reduce_grads,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from megatron_sp.tensor_parallel.random import RNGTracker, get_rng_state, set_rng_state
from megatron_sp.tensor_parallel.utils import check_divisible, divide

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "full_shape", "shard_of_full", "gather_full_like",
    "set_tp_attributes", "sequence_parallel_linear",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "all_reduce_grads",
    "RNGTracker", "get_rng_state", "set_rng_state", "check_divisible", "divide",
]
