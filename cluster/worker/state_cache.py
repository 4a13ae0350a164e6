"""The recurrent states of one worker's linear-attention layers, per request, beside the
paged KV cache.

Each running request holds a slot. Per recurrent layer a slot keeps `num_snapshots`
states: the convolution's last inputs `[kernel - 1, conv_dim]` (model dtype) and the
recurrent matrices `[heads, head_k_dim, head_v_dim]` (float32), after each of the last
`num_snapshots` tokens the request's previous step computed.

Why several: a speculative step runs the last token and k drafts (k + 1 tokens) before
anyone knows how many drafts the target accepts. Instead of recomputing, the step keeps
the state after each of those k + 1 tokens (`num_snapshots = k + 1`), and the next step
starts from the one after the last token the request kept, which its
`num_computed_tokens` says: rejected drafts leave no trace. A prefill chunk keeps the
states after its last tokens the same way, so the next chunk continues from its end.

Slots follow the scheduler's messages: a new request takes one, a freed request
(finished, aborted or preempted) gives it back; a preempted request comes back as new
and recomputes from position 0, so from a zero state. Prefix-cache hits would start a
request past 0 with no state, so engines with recurrent layers run without prefix
caching (`cluster.config.architectures.RECURRENT_ARCHITECTURES`).
"""

from __future__ import annotations

import torch

from cluster.engine.messages import ScheduledRequest
from cluster.models.gated_delta import RecurrentShape


class RecurrentStateCache:
    def __init__(
        self,
        layer_shapes: dict[int, RecurrentShape],
        num_slots: int,
        num_snapshots: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_snapshots = num_snapshots
        self.conv: dict[int, torch.Tensor] = {}  # [slots, snapshots, kernel - 1, conv_dim]
        self.recurrent: dict[int, torch.Tensor] = {}  # [slots, snapshots, heads, dk, dv]
        for layer_idx, s in layer_shapes.items():
            self.conv[layer_idx] = torch.zeros(
                num_slots, num_snapshots, s.kernel - 1, s.conv_dim, dtype=dtype, device=device
            )
            self.recurrent[layer_idx] = torch.zeros(
                num_slots, num_snapshots, s.num_heads, s.head_k_dim, s.head_v_dim, device=device
            )
        self.device = torch.device(device)
        self.slot_of: dict[str, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        # per slot: the position whose state snapshot 0 holds, and how many are held
        self.first_position = [0] * num_slots
        self.num_kept = [0] * num_slots

    @staticmethod
    def bytes_per_slot(
        layer_shapes: dict[int, RecurrentShape], num_snapshots: int, dtype: torch.dtype
    ) -> int:
        return num_snapshots * sum(
            (s.kernel - 1) * s.conv_dim * dtype.itemsize
            + s.num_heads * s.head_k_dim * s.head_v_dim * 4
            for s in layer_shapes.values()
        )

    def add(self, req_id: str) -> None:
        if not self._free:
            raise RuntimeError(
                f"no recurrent-state slot left for request {req_id!r} "
                f"({len(self.slot_of)} held; the scheduler runs more requests than "
                "scheduler.max_num_seqs)"
            )
        slot = self._free.pop()
        self.slot_of[req_id] = slot
        self.num_kept[slot] = 0

    def remove(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def begin_step(self, scheduled: list[ScheduledRequest]) -> CachedStepStates:
        """The step's view: where each request starts from and which states it keeps.
        Raises if a request resumes at a position whose state was not kept."""
        slots, read, keep = [], [], []
        max_len = max(len(s.token_ids) for s in scheduled)
        for item in scheduled:
            slot = self.slot_of[item.req_id]
            start, n = item.num_computed_tokens, len(item.token_ids)
            index = start - 1 - self.first_position[slot]
            if start == 0:
                index = -1  # a fresh (or recomputed) request: zero state
            elif not 0 <= index < self.num_kept[slot]:
                first = self.first_position[slot]
                raise RuntimeError(
                    f"request {item.req_id!r} resumes after position {start - 1}, but its "
                    f"recurrent state is kept only after positions "
                    f"[{first}, {first + self.num_kept[slot]})"
                )
            slots.append(slot)
            read.append(index)
            kept = min(n, self.num_snapshots)  # after the last `kept` tokens, at 0..kept-1
            row = [-1] * max_len
            row[n - kept : n] = range(kept)
            keep.append(row)
        return CachedStepStates(self, scheduled, slots, read, keep)

    def end_step(self, step: CachedStepStates) -> None:
        """After the forward: each request now holds the states it kept."""
        for item, slot in zip(step.scheduled, step.slot_list, strict=True):
            n = len(item.token_ids)
            kept = min(n, self.num_snapshots)
            self.first_position[slot] = item.num_computed_tokens + n - kept
            self.num_kept[slot] = kept


class CachedStepStates:
    """`cluster.models.gated_delta.StepStates` over a `RecurrentStateCache`."""

    def __init__(
        self,
        cache: RecurrentStateCache,
        scheduled: list[ScheduledRequest],
        slots: list[int],
        read: list[int],
        keep: list[list[int]],
    ) -> None:
        device = cache.device
        self.cache = cache
        self.scheduled = scheduled
        self.slot_list = slots
        self.slots = torch.tensor(slots, device=device)  # [num_seqs]
        read_t = torch.tensor(read, device=device)
        self.fresh = read_t < 0  # [num_seqs]
        self.read_index = read_t.clamp(min=0)
        self.keep = torch.tensor(keep, device=device)  # [num_seqs, max_len]

    def read(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        conv = self.cache.conv[layer_idx][self.slots, self.read_index]
        recurrent = self.cache.recurrent[layer_idx][self.slots, self.read_index]
        conv = conv.masked_fill(self.fresh[:, None, None], 0)
        recurrent = recurrent.masked_fill(self.fresh[:, None, None, None], 0)
        return conv, recurrent

    def snapshot_index(self) -> torch.Tensor:
        return self.keep

    def write(
        self,
        layer_idx: int,
        seqs: torch.Tensor,
        index: torch.Tensor,
        conv: torch.Tensor,
        recurrent: torch.Tensor,
    ) -> None:
        slots = self.slots[seqs]
        self.cache.conv[layer_idx][slots, index] = conv.to(self.cache.conv[layer_idx].dtype)
        self.cache.recurrent[layer_idx][slots, index] = recurrent
