"""Pipeline stages: which layers a stage owns, and the activations passed stage to stage.

A stage runs a contiguous range of decoder layers. Between stages travel, per token,
the hidden state, the residual stream and the EAGLE-3 auxiliary hidden states taken so
far (from layers on earlier stages), packed into one tensor so one point-to-point send
per step carries them all. Each TP rank sends to its peer (same TP rank) in the next
stage: within a stage those tensors are identical on every TP rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.config import stage_layer_counts
from cluster.parallel.comm import recv, send
from cluster.parallel.state import ParallelState


def stage_layer_range(num_layers: int, state: ParallelState) -> tuple[int, int]:
    """[start, end) of the decoder layers on `state`'s pipeline stage."""
    counts = stage_layer_counts(num_layers, state.pp_size, state.pp_layer_partition)
    start = sum(counts[: state.pp_rank])
    return start, start + counts[state.pp_rank]


@dataclass
class StageActivations:
    """What one stage hands the next. Every tensor is [num_tokens, hidden_size]."""

    hidden: torch.Tensor
    residual: torch.Tensor
    aux: list[torch.Tensor]  # EAGLE-3 auxiliary hidden states, in ascending layer order

    def send_to_next_stage(self, state: ParallelState) -> None:
        packed = torch.cat([self.hidden, self.residual, *self.aux], dim=-1)
        send(packed, state.stage_rank(state.pp_rank + 1), state)

    @staticmethod
    def recv_from_previous_stage(
        state: ParallelState,
        num_tokens: int,
        hidden_size: int,
        num_aux: int,
        dtype: torch.dtype,
    ) -> StageActivations:
        shape = (num_tokens, (2 + num_aux) * hidden_size)
        packed = recv(shape, dtype, state.stage_rank(state.pp_rank - 1), state)
        hidden, residual, *aux = packed.split(hidden_size, dim=-1)
        return StageActivations(hidden, residual, list(aux))
