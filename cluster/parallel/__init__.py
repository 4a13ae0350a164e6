"""Tensor/pipeline parallel state, collectives and layers."""

from cluster.parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from cluster.parallel.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from cluster.parallel.state import ParallelState, destroy_parallel_state, init_parallel_state

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "ParallelState",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "destroy_parallel_state",
    "init_parallel_state",
]
