"""What every speculative draft head shares: the interface the proposer drives, and
the sharing of the target's embedding and LM head.

A draft is run in passes. Pass 0 takes the target's features at every verified
position (`combine_target_hidden` turns the target's output into the draft's input);
pass `step >= 1` takes the draft's own `next_hidden` from the pass before.
`forward` returns `(logits_hidden, next_hidden)`; `compute_logits` maps the former
to target-vocabulary logits. Draft attention layers are numbered after the target's
(`first_layer_idx`), so their KV lives in the same paged cache under their own layers.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from cluster.models.llama import LlamaForCausalLM
from cluster.parallel import ParallelLMHead, ParallelState, VocabParallelEmbedding


class DraftModel(nn.Module):
    """Base of the draft heads. Subclasses set `num_attention_layers` and implement
    `forward`; embedding and head are their own when the checkpoint has them."""

    # Every head is built from Llama blocks: the same checkpoint-name mapping.
    packed_modules_mapping: ClassVar = LlamaForCausalLM.packed_modules_mapping
    ignored_checkpoint_tensors: ClassVar = (*LlamaForCausalLM.ignored_checkpoint_tensors, "t2d")
    num_attention_layers: int = 1
    # How many different computations its passes make (`forward(..., step)` depends on
    # `step` only through `step % num_step_kinds`): MTP heads cycle through their layers.
    num_step_kinds: int = 1
    # The target's modules are used when the checkpoint has none (or always, for MTP).
    embed_tokens: VocabParallelEmbedding | None
    lm_head: ParallelLMHead | None

    def __init__(
        self,
        config: Any,
        target_config: Any,
        state: ParallelState,
        dtype: torch.dtype,
        tensor_names: set[str],
    ) -> None:
        super().__init__()
        self.config = config
        self.target_config = target_config
        self.state = state
        self.first_layer_idx = int(target_config.num_hidden_layers)
        self.build(config, state, dtype, tensor_names)

    def build(
        self, config: Any, state: ParallelState, dtype: torch.dtype, tensor_names: set[str]
    ) -> None:
        """Create the head's modules (`tensor_names`: the tensors its checkpoint holds)."""
        raise NotImplementedError

    def share_with_target(self, target: nn.Module) -> None:
        """Take the target's embedding and LM head where the draft has none."""
        if self.embed_tokens is None:
            self.embed_tokens = target.model.embed_tokens
        if self.lm_head is None:
            self.lm_head = target.lm_head

    def combine_target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pass-0 features from the target's output (default: the final hidden states)."""
        return hidden

    def forward(
        self,
        input_ids: torch.Tensor,  # [n]
        hidden: torch.Tensor,  # [n, hidden]
        positions: torch.Tensor,  # [n]
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def compute_logits(self, logits_hidden: torch.Tensor, step: int) -> torch.Tensor:
        """[n, hidden] -> [n, target_vocab]."""
        assert self.lm_head is not None
        return self.lm_head(logits_hidden)

    def map_checkpoint_name(self, name: str) -> str | None:
        """Checkpoint tensor name -> parameter name (None: not a tensor of this draft)."""
        return name
