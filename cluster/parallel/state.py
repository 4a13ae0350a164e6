"""Explicit parallel state: who this process is among the tensor and pipeline ranks.

Nothing here is global. Code that needs ranks or process groups receives a
`ParallelState`; a single-process run uses `ParallelState.single()`, whose
collectives are no-ops. Global rank layout: `rank = pp_rank * tp_size + tp_rank`,
so the ranks of one pipeline stage are contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    # None when the group has a single member (every collective is then a no-op).
    tp_group: dist.ProcessGroup | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # Decoder layers per pipeline stage; None: an even split (see `parallel.pipeline`).
    pp_layer_partition: tuple[int, ...] | None = None
    # Expert parallelism: 1 (every TP rank holds a slice of every expert) or tp_size (the
    # TP ranks hold whole experts, a 1/tp_size share each, and exchange tokens).
    ep_size: int = 1

    @staticmethod
    def single(device: str | torch.device = "cpu") -> ParallelState:
        return ParallelState(0, 1, 0, 1, None, torch.device(device))

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of this TP rank's peer in pipeline stage `pp_rank`."""
        return pp_rank * self.tp_size + self.tp_rank


def init_parallel_state(
    rank: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    init_method: str,
    backend: str,
    device: str | torch.device = "cpu",
    timeout_s: float = 300.0,
    pp_layer_partition: tuple[int, ...] | None = None,
    expert_parallel_size: int = 1,
) -> ParallelState:
    """Join the process group (world = tp * pp) and build this rank's TP group.

    `init_method` is a rendezvous URL found at run time (e.g. `tcp://127.0.0.1:<free port>`
    or `file://...`); nothing is hard-coded.
    """
    world_size = tensor_parallel_size * pipeline_parallel_size
    if expert_parallel_size not in (1, tensor_parallel_size):
        raise ValueError(
            f"expert_parallel_size={expert_parallel_size} must be 1 or the tensor-parallel "
            f"size ({tensor_parallel_size}): the experts are spread over one stage's TP ranks"
        )
    if world_size == 1:
        return ParallelState.single(device)
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    pp_rank, tp_rank = divmod(rank, tensor_parallel_size)
    tp_group = None
    # Every rank must take part in creating every group, in the same order.
    for stage in range(pipeline_parallel_size):
        ranks = list(range(stage * tensor_parallel_size, (stage + 1) * tensor_parallel_size))
        group = dist.new_group(ranks) if tensor_parallel_size > 1 else None
        if stage == pp_rank:
            tp_group = group
    return ParallelState(
        tp_rank=tp_rank,
        tp_size=tensor_parallel_size,
        pp_rank=pp_rank,
        pp_size=pipeline_parallel_size,
        tp_group=tp_group,
        device=torch.device(device),
        pp_layer_partition=pp_layer_partition,
        ep_size=expert_parallel_size,
    )


def destroy_parallel_state(state: ParallelState) -> None:
    if state.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
