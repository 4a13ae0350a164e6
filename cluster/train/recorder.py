"""Draft-head features recorded while the target answers, so no second forward is needed.

The target computes, for every token it processes, exactly what a draft head is fed at
inference: the residual streams entering the EAGLE-3 layers and the final hidden state
(after the final norm; EAGLE-1 and MTP). `FeatureRecorder` takes them from the model
runner's own capture (`ModelRunner.capture_features`, the outputs EAGLE-3 drafting reads)
of an in-process, eager engine (`LLM(..., compile="off", enable_prefix_caching=False)`:
a prefix-cache hit skips the forward) and keeps those rows per request and position in
the engine's dtype. A sequence's last token is never fed back, so its row stays zero; no training
row reads it (its label would lie past the end).
"""

from __future__ import annotations

from typing import Any

import torch

from cluster.engine.messages import ScheduledRequest


class FeatureRecorder:
    def __init__(self, llm: Any, aux_layers: tuple[int, ...]) -> None:
        executor = llm.engine.core.executor
        runner = getattr(getattr(executor, "worker", None), "runner", None)
        if runner is None or llm.config.compiles:
            raise ValueError("recording needs an in-process, eager engine (compile='off')")
        if llm.config.prefix_caching:
            raise ValueError("recording needs enable_prefix_caching=False (hits skip the forward)")
        self.aux_layers = aux_layers
        self.hidden_size = int(llm.config.model.hf_config.hidden_size)
        self._rows: dict[str, dict[int, torch.Tensor]] = {}  # req_id -> position -> [F]
        self._runner = runner
        runner.capture_features(aux_layers, self._record)

    def _record(self, scheduled: list[ScheduledRequest], rows: torch.Tensor) -> None:
        """One step's rows ([num_tokens, (len(aux) + 1) * hidden]), kept per position."""
        if any(s.num_spec_tokens for s in scheduled):
            raise ValueError("recording runs without speculation (drafts are not the answer)")
        rows = rows.clone()
        start = 0
        for s in scheduled:
            per_position = self._rows.setdefault(s.req_id, {})
            for offset in range(len(s.token_ids)):
                per_position[s.num_computed_tokens + offset] = rows[start + offset]
            start += len(s.token_ids)

    def take(self, req_id: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux features [length, len(aux) * hidden], final hidden [length, hidden]) of a
        finished request, in the engine's dtype, and forget it. Raises if any position but the last
        was not recorded."""
        per_position = self._rows.pop(req_id, {})
        missing = [p for p in range(length - 1) if p not in per_position]
        if missing:
            raise ValueError(f"request {req_id}: positions {missing[:5]}... were not recorded")
        width = (len(self.aux_layers) + 1) * self.hidden_size
        dtype = next(iter(per_position.values())).dtype if per_position else torch.float32
        rows = torch.zeros(length, width, dtype=dtype)
        for position, row in per_position.items():
            if position < length:
                rows[position] = row
        split = len(self.aux_layers) * self.hidden_size
        return rows[:, :split], rows[:, split:]

    def close(self) -> None:
        self._runner.capture_features((), None)
