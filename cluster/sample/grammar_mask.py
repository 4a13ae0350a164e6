"""Guided decoding's masks on the logits: tokens a request's grammar forbids get -inf.

The engine core sends each guided row's allowed tokens as xgrammar's bitmask (int32
words, bit `t % 32` of word `t // 32` set when token `t` is allowed); `apply_token_bitmask`
unpacks it with torch ops (any device), so the rows sample, verify drafts and report
logprobs under the grammar. xgrammar's own `apply_token_bitmask_inplace` is the
reference the tests compare it with.
"""

from __future__ import annotations

import torch


def unpack_token_bitmask(
    bitmask: torch.Tensor,  # [rows, words] int32
    vocab_size: int,
) -> torch.Tensor:
    """[rows, vocab_size] bool: True where the token is allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1  # [rows, words, 32]
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(
    logits: torch.Tensor,  # [num_logits, vocab], modified in place
    bitmask: torch.Tensor,  # [rows, words] int32
    row_indices: torch.Tensor,  # [rows] int64: the logits row each bitmask row masks
) -> None:
    """Set the logits of the tokens each masked row forbids to -inf."""
    allowed = unpack_token_bitmask(bitmask, logits.shape[1])
    rows = logits.index_select(0, row_indices).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, row_indices, rows)


def bitmask_rows(
    bitmasks: list[tuple[int, int, bytes]],  # (first logits row, rows, packed int32 bits)
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's guided rows as one ([rows, words] int32 bitmask, [rows] row indices)."""
    masks = [
        torch.frombuffer(bytearray(bits), dtype=torch.int32).view(n, -1) for _, n, bits in bitmasks
    ]
    rows = [r for first, n, _ in bitmasks for r in range(first, first + n)]
    return torch.cat(masks).to(device), torch.tensor(rows, dtype=torch.int64, device=device)
