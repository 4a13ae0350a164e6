"""`InputBatch`: the worker's persistent block tables, and the flattened model inputs of
one step gathered from them."""

from __future__ import annotations

import itertools
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


class InputBatch:
    """What a worker keeps of its running requests' inputs between steps: each request's
    row of one block table ([rows, columns] int64, grown by doubling), written where a
    step appends blocks and cleared when the request leaves, never rebuilt. A step's slot
    mapping and block tables are gathered from it in a few tensor operations, whatever the
    number of tokens; one copy per tensor then takes them to the device."""

    def __init__(self, block_size: int, device: torch.device, rows: int = 16, columns: int = 16):
        self.block_size = block_size
        self.device = device
        self.block_table = torch.zeros(rows, columns, dtype=torch.int64)  # [rows, columns]
        self.num_blocks = [0] * rows  # per row
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))

    def add(self, req_id: str) -> None:
        if not self._free_rows:
            rows = self.block_table.shape[0]
            self._grow(2 * rows, self.block_table.shape[1])
            self.num_blocks += [0] * rows
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        self.row_of[req_id] = self._free_rows.pop()

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.block_table[row, : self.num_blocks[row]] = 0
            self.num_blocks[row] = 0
            self._free_rows.append(row)

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        row = self.row_of[req_id]
        start = self.num_blocks[row]
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            self._grow(self.block_table.shape[0], max(end, 2 * self.block_table.shape[1]))
        self.block_table[row, start:end] = torch.tensor(block_ids, dtype=torch.int64)
        self.num_blocks[row] = end

    def blocks_of(self, req_id: str) -> int:
        return self.num_blocks[self.row_of[req_id]]

    def _grow(self, rows: int, columns: int) -> None:
        table = torch.zeros(rows, columns, dtype=torch.int64)
        old_rows, old_columns = self.block_table.shape
        table[:old_rows, :old_columns] = self.block_table
        self.block_table = table

    def prepare(self, scheduled: list[ScheduledRequest]) -> ModelInputs:
        """The step's flattened inputs: token i of a request that has computed `start`
        tokens is its token `start + i`, in the slot its block table gives that index."""
        block_size = self.block_size
        rows = [self.row_of[item.req_id] for item in scheduled]
        counts = [len(item.token_ids) for item in scheduled]
        starts = [item.num_computed_tokens for item in scheduled]
        query_start_loc = list(itertools.accumulate(counts, initial=0))
        seq_lens = [s + n for s, n in zip(starts, counts, strict=True)]
        for item, row, end in zip(scheduled, rows, seq_lens, strict=True):
            if (end - 1) // block_size >= self.num_blocks[row]:
                raise RuntimeError(f"request {item.req_id}: token {end - 1} has no block")
        # each token's row, and its index in its sequence (its start, plus its place in
        # the step); the slots are then gathered in tensor operations
        token_rows: list[int] = []
        token_index: list[int] = []
        for row, start, n in zip(rows, starts, counts, strict=True):
            token_rows += [row] * n
            token_index += range(start, start + n)
        index = torch.tensor(token_index, dtype=torch.int64)
        token_rows_t = torch.tensor(token_rows, dtype=torch.int64)
        slot_mapping = (
            self.block_table[token_rows_t, index // block_size] * block_size + index % block_size
        )
        positions, tree_bits = index, None
        if any(item.spec_parents is not None for item in scheduled):
            positions, tree_bits = _tree_positions(scheduled, starts)
        logits_indices: list[int] = []
        sampled: list[ScheduledRequest] = []
        for item, end in zip(scheduled, query_start_loc[1:], strict=True):
            if item.sample:
                logits_indices.extend(range(end - item.num_spec_tokens - 1, end))
                sampled.append(item)
        max_blocks = max(self.num_blocks[row] for row in rows)
        tables = self.block_table[torch.tensor(rows), :max_blocks]  # [num_seqs, max_blocks]
        device = self.device
        input_ids = [t for item in scheduled for t in item.token_ids]
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            positions=positions.to(device),
            slot_mapping=slot_mapping.to(device),
            block_tables=tables.to(device),
            tree_bits=None if tree_bits is None else tree_bits.to(device),
        )
        return ModelInputs(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            meta,
            torch.tensor(logits_indices, dtype=torch.int64, device=device),
            sampled,
        )


def _tree_positions(
    scheduled: list[ScheduledRequest], starts: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and attention bits of a step holding draft trees ([num_tokens] each;
    bits -1 for the rows of requests without a tree)."""
    positions: list[int] = []
    tree_bits: list[int] = []
    for item, start in zip(scheduled, starts, strict=True):
        n = len(item.token_ids)
        if item.spec_parents is None:
            positions.extend(range(start, start + n))
            tree_bits.extend([-1] * n)
        else:
            offsets, bits = _tree_rows(n, item.spec_parents)
            positions.extend(start + p for p in offsets)
            tree_bits.extend(bits)
    return torch.tensor(positions, dtype=torch.int64), torch.tensor(tree_bits, dtype=torch.int64)


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
