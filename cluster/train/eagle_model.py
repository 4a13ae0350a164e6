"""A trainable EAGLE-1 head with training-time test (TTT, see `cluster/train/ttt.py`).

The engine's `EagleLlama` with one layer, in plain torch: `fc(concat(embed, hidden))` is
both the attention input (layer 0 has no input norm) and the residual; the block's output
is the next hidden, read by the target's LM head directly (no final norm). The features
are the target's final hidden states (after its final norm: what the engine feeds the
head in pass 0). Parameters under the public names (`fc.weight`, `layers.0.*`); the
target's embedding and LM head are frozen copies kept out of the state dict.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cluster.train.ttt import FrozenTable, TTTDecoderLayer, TTTHead


class EagleTrainable(TTTHead):
    def __init__(
        self, target_config: Any, embed_weight: torch.Tensor, head_weight: torch.Tensor
    ) -> None:
        super().__init__()
        h = target_config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([TTTDecoderLayer(target_config, qkv_in=h, input_norm=False)])
        self.embed = FrozenTable(embed_weight)
        self.target_head = FrozenTable(head_weight)

    def block(self) -> TTTDecoderLayer:
        return self.layers[0]

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed.embed(ids)

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(torch.cat([embeds, hidden], dim=-1))
        return h, h

    def logits(self, output: torch.Tensor) -> torch.Tensor:
        return self.target_head.logits(output)

    def export_state(self) -> dict[str, torch.Tensor]:
        """Tensors in the public EAGLE-1 layout (no embedding or LM head: the target's)."""
        return {k: v.detach().clone().contiguous() for k, v in self.state_dict().items()}
