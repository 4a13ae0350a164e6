"""A trainable EAGLE-3 head with training-time test (TTT, see `cluster/train/ttt.py`).

Same parameters and names as the public EAGLE-3 layout our engine loads (`fc`,
`midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`), in plain torch so autograd runs through
it. Step 0's hidden is `fc` of the three target aux states; the block's input is
`concat(input_layernorm(embed), hidden_norm(hidden))` with `hidden` as its residual; the
logits are `lm_head(norm(output))` over the draft vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cluster.train.ttt import RMSNorm, TTTDecoderLayer, TTTHead


class Eagle3Trainable(TTTHead):
    def __init__(
        self, target_config: Any, draft_vocab_size: int, embed_weight: torch.Tensor
    ) -> None:
        super().__init__()
        cfg = target_config
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = TTTDecoderLayer(cfg, qkv_in=2 * h, hidden_norm=True)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.embed = nn.Embedding.from_pretrained(embed_weight.float(), freeze=True)  # the target's

    def block(self) -> TTTDecoderLayer:
        return self.midlayer

    def first_hidden(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features.float())

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.midlayer
        return torch.cat([m.input_layernorm(embeds), m.hidden_norm(hidden)], dim=-1), hidden

    def logits(self, output: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(output))

    def export_state(self, d2t: torch.Tensor, t2d: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tensors in the public EAGLE-3 layout (no embedding: the target's is shared)."""
        state = {
            k: v.detach().clone().contiguous()
            for k, v in self.state_dict().items()
            if not k.startswith("embed.")
        }
        state["d2t"] = d2t
        state["t2d"] = t2d
        return state
