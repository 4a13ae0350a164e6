"""Draft-head features recorded while the target answers, so no second forward is needed.

The target computes, for every token it processes, exactly what a draft head is fed at
inference: the residual streams entering the EAGLE-3 layers and the final hidden state
(after the final norm; EAGLE-1 and MTP). `FeatureRecorder` hooks an in-process, eager
engine (`LLM(..., compile="off", enable_prefix_caching=False)`: a compiled graph or a
prefix-cache hit would skip the hooks) and keeps those rows per request and position in
the engine's dtype. A sequence's last token is never fed back, so its row stays zero; no training
row reads it (its label would lie past the end).
"""

from __future__ import annotations

from typing import Any

import torch

from cluster.engine.messages import SchedulerOutput


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
        self._step: list[tuple[str, int, int]] = []  # (req_id, first position, num rows)
        self._aux: dict[int, torch.Tensor] = {}
        layers = runner.model.model.layers
        self._hooks = [
            layers[i].register_forward_pre_hook(self._aux_hook(i)) for i in set(aux_layers)
        ]
        self._hooks.append(runner.model.model.register_forward_hook(self._final_hook))
        self._runner, self._execute = runner, runner.execute_model
        runner.execute_model = self._execute_model

    def _execute_model(self, so: SchedulerOutput) -> Any:
        self._step = [(s.req_id, s.num_computed_tokens, len(s.token_ids)) for s in so.scheduled]
        if any(s.num_spec_tokens for s in so.scheduled):
            raise ValueError("recording runs without speculation (drafts are not the answer)")
        return self._execute(so)

    def _aux_hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            _rope, hidden, residual = args[:3]
            self._aux[layer] = hidden if residual is None else hidden + residual

        return hook

    def _final_hook(self, module: torch.nn.Module, args: tuple, out: Any) -> None:
        hidden = out[0] if isinstance(out, tuple) else out  # [num_tokens, hidden]
        rows = torch.cat([*(self._aux[i] for i in self.aux_layers), hidden], dim=-1)
        rows = rows.clone()  # [num_tokens, (len(aux) + 1) * hidden]
        start = 0
        for req_id, first, count in self._step:
            per_position = self._rows.setdefault(req_id, {})
            for offset in range(count):
                per_position[first + offset] = rows[start + offset]
            start += count
        self._aux.clear()

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
        for hook in self._hooks:
            hook.remove()
        self._runner.execute_model = self._execute
