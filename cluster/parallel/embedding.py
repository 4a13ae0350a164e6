"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded up to a multiple of the TP size and each rank holds a
contiguous slice of rows. The embedding masks ids outside its slice, looks up,
zeroes the masked rows and all-reduces. The LM head computes its slice of the
logits and all-gathers them, dropping the padding columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cluster.kernels.packed_linear import can_pack, linear, pack_weight
from cluster.parallel.comm import all_gather, all_reduce
from cluster.parallel.state import ParallelState
from cluster.parallel.weights import TensorLike, copy_shard, tensor_name


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        state: ParallelState,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.state = state
        self.num_embeddings = num_embeddings
        self.padded_num_embeddings = -(-num_embeddings // state.tp_size) * state.tp_size
        self.rows_per_rank = self.padded_num_embeddings // state.tp_size
        self.vocab_start = state.tp_rank * self.rows_per_rank
        self.vocab_end = self.vocab_start + self.rows_per_rank
        self.weight = nn.Parameter(
            torch.zeros(self.rows_per_rank, embedding_dim, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: TensorLike) -> None:
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(
                f"{tensor_name(loaded)}: checkpoint shape {tuple(loaded.shape)} does not match "
                f"vocab_size={self.num_embeddings}"
            )
        num_real = max(0, min(self.vocab_end, self.num_embeddings) - self.vocab_start)
        param.data.zero_()
        if num_real:
            copy_shard(param.data.narrow(0, 0, num_real), loaded, 0, self.vocab_start, num_real)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, hidden]
        if self.state.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_slice = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * in_slice
        out = F.embedding(local_ids, self.weight) * in_slice.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out, self.state)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary, gathered on every TP rank."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        state: ParallelState,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, state, dtype)
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(self.rows_per_rank, dtype=dtype), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.packed_weight: torch.Tensor | None = None  # see `pack`

    def pack(self, kernel: str = "auto") -> None:
        """Prepack the loaded weight for this CPU's bfloat16 units, where that pays
        (`cluster.kernels.packed_linear`, which `kernel` goes to); a tied weight keeps its
        plain copy for the embedding."""
        self.packed_weight = pack_weight(self.weight, kernel) if can_pack(self.weight) else None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (`tie_word_embeddings`)."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_tokens, hidden] -> logits [num_tokens, vocab]
        logits = linear(hidden, self.weight, self.bias, self.packed_weight)
        logits = all_gather(logits, self.state, dim=-1)
        return logits[..., : self.num_embeddings]
