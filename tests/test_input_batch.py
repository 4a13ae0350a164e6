"""The persistent `InputBatch` against a per-token oracle that rebuilds every step's inputs
from scratch: the same inputs on random workloads where requests come and go (rows are
reused, the table grows in rows and columns), with chunked prompts, chains and trees."""

from __future__ import annotations

import random

import pytest
import torch

from cluster.engine.messages import ScheduledRequest
from cluster.worker.input_batch import InputBatch, _tree_rows

BLOCK_SIZE = 4


def rebuilt(scheduled: list[ScheduledRequest], tables: dict[str, list[int]]) -> dict:
    """Every step input, token by token, from each request's whole block table."""
    ids, positions, slots, bits, logits, starts, lens = [], [], [], [], [], [0], []
    has_tree = any(s.spec_parents is not None for s in scheduled)
    for item in scheduled:
        table, start, n = tables[item.req_id], item.num_computed_tokens, len(item.token_ids)
        ids += item.token_ids
        slots += [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + n)
        ]
        if item.spec_parents is None:
            positions += range(start, start + n)
            bits += [-1] * n if has_tree else []
        else:
            offsets, tree_bits = _tree_rows(n, item.spec_parents)
            positions += [start + p for p in offsets]
            bits += tree_bits
        end = starts[-1] + n
        if item.sample:
            logits += range(end - item.num_spec_tokens - 1, end)
        starts.append(end)
        lens.append(start + n)
    width = max(len(tables[s.req_id]) for s in scheduled)
    block_tables = [tables[s.req_id] + [0] * (width - len(tables[s.req_id])) for s in scheduled]
    return {
        "input_ids": ids,
        "positions": positions,
        "slot_mapping": slots,
        "tree_bits": bits if has_tree else None,
        "logits_indices": logits,
        "query_start_loc": starts,
        "seq_lens": lens,
        "block_tables": block_tables,
    }


def prepared(batch: InputBatch, scheduled: list[ScheduledRequest]) -> dict:
    inputs = batch.prepare(scheduled)
    meta = inputs.meta
    return {
        "input_ids": inputs.input_ids.tolist(),
        "positions": meta.positions.tolist(),
        "slot_mapping": meta.slot_mapping.tolist(),
        "tree_bits": None if meta.tree_bits is None else meta.tree_bits.tolist(),
        "logits_indices": inputs.logits_indices.tolist(),
        "query_start_loc": list(meta.query_start_loc),
        "seq_lens": list(meta.seq_lens),
        "block_tables": meta.block_tables.tolist(),
    }


@pytest.mark.parametrize("seed", range(6))
def test_persistent_inputs_equal_inputs_rebuilt_every_step(seed):
    rng = random.Random(seed)
    batch = InputBatch(BLOCK_SIZE, torch.device("cpu"), rows=2, columns=2)
    tables: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    prompt_left: dict[str, int] = {}
    free_blocks = list(range(1, 500))
    rng.shuffle(free_blocks)
    next_id = 0
    checked = 0
    for _ in range(60):
        # requests arrive and leave (a leaving request's row is reused, stale ids cleared)
        if len(tables) < 9 and rng.random() < 0.5:
            req_id, next_id = f"r{next_id}", next_id + 1
            tables[req_id], computed[req_id] = [], 0
            prompt_left[req_id] = rng.randint(1, 40)
            batch.add(req_id)
        if tables and rng.random() < 0.2:
            gone = rng.choice(sorted(tables))
            free_blocks += tables.pop(gone)
            del computed[gone], prompt_left[gone]
            batch.remove(gone)
        scheduled = []
        for req_id in sorted(tables, key=lambda _: rng.random()):
            if prompt_left[req_id]:
                n = min(prompt_left[req_id], rng.randint(1, 16))
                prompt_left[req_id] -= n
                spec, parents, sample = 0, None, prompt_left[req_id] == 0
            else:
                spec = rng.randint(0, 4)
                parents = None
                if spec and rng.random() < 0.4:  # a draft tree: each node's parent before it
                    parents = [rng.randint(-1, i - 1) for i in range(spec)]
                n, sample = 1 + spec, True
            start = computed[req_id]
            need = -(-(start + n) // BLOCK_SIZE) - len(tables[req_id])
            new_blocks = [free_blocks.pop() for _ in range(max(0, need))]
            tables[req_id] += new_blocks
            batch.append_blocks(req_id, new_blocks)
            tokens = [rng.randint(0, 999) for _ in range(n)]
            scheduled.append(
                ScheduledRequest(req_id, tokens, start, spec, new_blocks, sample, parents)
            )
            # drafts past the first are rejected at random: the next step starts after
            # the accepted ones (their slots are written again)
            computed[req_id] = start + n - (rng.randint(0, spec) if spec else 0)
        if scheduled:
            assert prepared(batch, scheduled) == rebuilt(scheduled, tables)
            checked += 1
    assert checked > 40
    assert batch.block_table.shape[0] > 2 and batch.block_table.shape[1] > 2  # it grew


def test_a_token_without_a_block_is_refused():
    batch = InputBatch(BLOCK_SIZE, torch.device("cpu"))
    batch.add("a")
    batch.append_blocks("a", [7])
    ok = ScheduledRequest("a", [1, 2, 3, 4], 0, 0, [], True)
    assert prepared(batch, [ok])["slot_mapping"] == [28, 29, 30, 31]
    with pytest.raises(RuntimeError, match="request a: token 4 has no block"):
        batch.prepare([ScheduledRequest("a", [1, 2, 3, 4, 5], 0, 0, [], True)])
