"""A trainable DeepSeek-style MTP module with training-time test (see `cluster/train/ttt.py`).

The engine's `DeepSeekMTP` with one module, in plain torch: row p takes the target's
final hidden state at p and the embedding of token p + 1 and predicts token p + 2, through
`eh_proj(concat(enorm(embed), hnorm(hidden)))`, one Llama block (with its input norm) and
`shared_head.norm` before the target's LM head. At TTT step j >= 1 the same module runs on
its own output, as the engine chains it. Embedding and LM head are frozen copies of the
target's, kept out of the state dict; `export_state` names the tensors as layer
`num_hidden_layers` of the target (`model.layers.{L}.*`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cluster.train.ttt import FrozenTable, RMSNorm, TTTDecoderLayer, TTTHead


class DeepSeekMTPTrainable(TTTHead):
    def __init__(
        self,
        target_config: Any,
        embed_weight: torch.Tensor,
        head_weight: torch.Tensor,
        final_norm_weight: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        h, eps = target_config.hidden_size, target_config.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.mtp_block = TTTDecoderLayer(target_config, qkv_in=h)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, eps)
        if final_norm_weight is not None:  # logits on the target's scale from the start
            with torch.no_grad():
                self.shared_head.norm.weight.copy_(final_norm_weight)
        self.embed = FrozenTable(embed_weight)
        self.target_head = FrozenTable(head_weight)
        self.layer_index = int(target_config.num_hidden_layers)

    def block(self) -> TTTDecoderLayer:
        return self.mtp_block

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed.embed(ids)

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.mtp_block.input_layernorm(h), h

    def logits(self, output: torch.Tensor) -> torch.Tensor:
        return self.target_head.logits(self.shared_head.norm(output))

    def export_state(self) -> dict[str, torch.Tensor]:
        """Tensors in the DeepSeek MTP layout (`model.layers.{L}.{enorm,hnorm,eh_proj,
        shared_head.norm}` and the block's own tensors), without the shared LM head."""
        prefix = f"model.layers.{self.layer_index}."
        return {
            prefix + k.removeprefix("mtp_block."): v.detach().clone().contiguous()
            for k, v in self.state_dict().items()
        }
