"""Collectives over a `ParallelState`'s groups; each is a no-op at group size 1."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cluster.parallel.state import ParallelState


def all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum `x` over the TP group, in place; returns `x`."""
    if state.tp_size > 1:
        dist.all_reduce(x, group=state.tp_group)
    return x


def all_gather(x: torch.Tensor, state: ParallelState, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's `x` along `dim` (rank order)."""
    if state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=state.tp_group)
    return torch.cat(parts, dim=dim)


def gather(
    x: torch.Tensor, state: ParallelState, dim: int = -1, dst: int = 0
) -> torch.Tensor | None:
    """Concatenate every TP rank's `x` along `dim` on TP rank `dst`; other ranks get None."""
    if state.tp_size == 1:
        return x
    group_dst = dist.get_global_rank(state.tp_group, dst)
    parts = [torch.empty_like(x) for _ in range(state.tp_size)] if state.tp_rank == dst else None
    dist.gather(x.contiguous(), parts, dst=group_dst, group=state.tp_group)
    return torch.cat(parts, dim=dim) if parts is not None else None


def send(x: torch.Tensor, dst: int, state: ParallelState) -> None:
    """Send `x` to global rank `dst` (pipeline stage to stage)."""
    if state.world_size > 1:
        dist.send(x.contiguous(), dst=dst)


def recv(
    shape: tuple[int, ...], dtype: torch.dtype, src: int, state: ParallelState
) -> torch.Tensor:
    """Receive a tensor of known `shape` and `dtype` from global rank `src`."""
    out = torch.empty(shape, dtype=dtype, device=state.device)
    if state.world_size > 1:
        dist.recv(out, src=src)
    return out


def all_to_all(
    x: torch.Tensor, send_counts: list[int], recv_counts: list[int], state: ParallelState
) -> torch.Tensor:
    """Rows of `x` to the TP ranks (`send_counts[r]` consecutive rows to rank r, in rank
    order); returns the `sum(recv_counts)` rows received, in rank order."""
    if state.tp_size == 1:
        return x
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=state.tp_group)
    return out
