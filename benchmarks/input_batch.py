"""A step's model inputs: the persistent `InputBatch` against rebuilding them every step.

The baseline is the per-token rebuild the worker ran before the input batch persisted
(each request's block table copied into a fresh tensor, every slot computed in Python);
both sides return the same tensors (checked here, and by `tests/test_input_batch.py`).
Shapes: decode steps (1 token per request, or 1 + k with k drafts) and a prefill chunk.
Sides run interleaved (A, B, B, A, ...); medians in microseconds per step.

    python benchmarks/input_batch.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from functools import partial

import torch

from cluster.engine.messages import ScheduledRequest
from cluster.worker.input_batch import InputBatch

BLOCK_SIZE = 16


def rebuilt(scheduled: list[ScheduledRequest], tables: dict[str, list[int]]) -> tuple:
    """The baseline: every input built token by token from the whole block tables."""
    input_ids, positions, slots, logits, starts, lens = [], [], [], [], [0], []
    for item in scheduled:
        table, start, n = tables[item.req_id], item.num_computed_tokens, len(item.token_ids)
        input_ids.extend(item.token_ids)
        for pos in range(start, start + n):
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        positions.extend(range(start, start + n))
        end = starts[-1] + n
        if item.sample:
            logits.extend(range(end - item.num_spec_tokens - 1, end))
        starts.append(end)
        lens.append(start + n)
    width = max(len(tables[s.req_id]) for s in scheduled)
    block_tables = torch.zeros(len(scheduled), width, dtype=torch.int64)
    for i, item in enumerate(scheduled):
        block_tables[i, : len(tables[item.req_id])] = torch.tensor(tables[item.req_id])

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return tensor(input_ids), tensor(positions), tensor(slots), block_tables, tensor(logits)


def workload(num_requests: int, context: int, new_tokens: int) -> tuple:
    rng = random.Random(0)
    batch = InputBatch(BLOCK_SIZE, torch.device("cpu"))
    tables, scheduled, next_block = {}, [], 0
    for r in range(num_requests):
        req_id = f"r{r}"
        n_blocks = -(-(context + new_tokens) // BLOCK_SIZE)
        tables[req_id] = list(range(next_block, next_block + n_blocks))
        next_block += n_blocks
        batch.add(req_id)
        batch.append_blocks(req_id, tables[req_id])
        tokens = [rng.randint(0, 49151) for _ in range(new_tokens)]
        spec = new_tokens - 1 if new_tokens <= 5 else 0
        scheduled.append(ScheduledRequest(req_id, tokens, context, spec, [], True))
    return batch, tables, scheduled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    cases = [
        ("decode, 1 request", 1, 500, 1),
        ("decode, 64 requests", 64, 500, 1),
        ("verify k=3, 64 requests", 64, 500, 4),
        ("prefill chunk, 1 x 2048", 1, 0, 2048),
    ]
    print("| step | rebuilt every step (us) | persistent InputBatch (us) | speed-up |")
    print("|---|---:|---:|---:|")
    for label, num_requests, context, new_tokens in cases:
        batch, tables, scheduled = workload(num_requests, context, new_tokens)
        inputs = batch.prepare(scheduled)
        base = rebuilt(scheduled, tables)
        same = [
            inputs.input_ids,
            inputs.meta.positions,
            inputs.meta.slot_mapping,
            inputs.meta.block_tables,
            inputs.logits_indices,
        ]
        assert all(torch.equal(a, b) for a, b in zip(same, base, strict=True)), label
        times: dict[str, list[float]] = {"rebuilt": [], "persistent": []}
        sides = {
            "rebuilt": partial(rebuilt, scheduled, tables),
            "persistent": partial(batch.prepare, scheduled),
        }
        for i in range(args.repeats):
            order = ("rebuilt", "persistent") if i % 2 == 0 else ("persistent", "rebuilt")
            for side in order:
                start = time.perf_counter()
                sides[side]()
                times[side].append(time.perf_counter() - start)
        old = statistics.median(times["rebuilt"]) * 1e6
        new = statistics.median(times["persistent"]) * 1e6
        print(f"| {label} | {old:.0f} | {new:.0f} | {old / new:.2f}x |")


if __name__ == "__main__":
    main()
