"""Turning a scheduler output into the flattened model inputs of one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.engine.messages import ScheduledRequest
from cluster.models.attention import AttentionMetadata


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    # Rows of the hidden states that need logits: for each sampled request, its last
    # `num_spec_tokens + 1` tokens (drafts' verifying rows, then the bonus row).
    logits_indices: torch.Tensor  # [num_logits]
    sampled: list[ScheduledRequest]  # the scheduled requests that sample this step, in order


def prepare_inputs(
    scheduled: list[ScheduledRequest],
    block_tables: dict[str, list[int]],
    block_size: int,
    device: torch.device,
) -> ModelInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    sampled: list[ScheduledRequest] = []
    tree_bits: list[int] = []
    has_tree = any(item.spec_parents is not None for item in scheduled)
    for item in scheduled:
        table = block_tables[item.req_id]
        start, n = item.num_computed_tokens, len(item.token_ids)
        input_ids.extend(item.token_ids)
        for pos in range(start, start + n):
            slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
        if item.spec_parents is None:
            positions.extend(range(start, start + n))
            tree_bits.extend([-1] * n if has_tree else [])
        else:
            tree_positions, bits = _tree_rows(n, item.spec_parents)
            positions.extend(start + p for p in tree_positions)
            tree_bits.extend(bits)
        end = query_start_loc[-1] + n
        if item.sample:
            logits_indices.extend(range(end - item.num_spec_tokens - 1, end))
            sampled.append(item)
        query_start_loc.append(end)
        seq_lens.append(start + n)
    max_blocks = max(len(block_tables[s.req_id]) for s in scheduled)
    tables = torch.zeros(len(scheduled), max_blocks, dtype=torch.int64)
    for i, item in enumerate(scheduled):
        table = block_tables[item.req_id]
        tables[i, : len(table)] = torch.tensor(table)

    def to_device(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    meta = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        positions=to_device(positions),
        slot_mapping=to_device(slot_mapping),
        block_tables=tables.to(device),
        tree_bits=to_device(tree_bits) if has_tree else None,
    )
    return ModelInputs(to_device(input_ids), meta, to_device(logits_indices), sampled)


def _tree_rows(n: int, parents: list[int]) -> tuple[list[int], list[int]]:
    """A step of `n` new tokens whose last `len(parents)` are draft-tree nodes (the token
    before them is the root): each token's position offset (the root's plus its depth) and
    its attention bits over the step's new tokens (everything up to the root, then its
    ancestors and itself)."""
    root = n - 1 - len(parents)
    positions = list(range(root + 1))
    bits = [(1 << (j + 1)) - 1 for j in range(root + 1)]
    for i, parent in enumerate(parents):
        above = bits[root] if parent < 0 else bits[root + 1 + parent]
        positions.append(positions[root] + 1 if parent < 0 else positions[root + 1 + parent] + 1)
        bits.append(above | 1 << (root + 1 + i))
    return positions, bits
