"""What a worker keeps between steps, against rebuilding it every step: the model inputs
(`InputBatch`) and the penalties' statistics (`PenaltyTables`).

The baseline is the per-token rebuild the worker ran before the input batch persisted
(each request's block table copied into a fresh tensor, every slot computed in Python);
both sides return the same tensors (checked here, and by `tests/test_input_batch.py`).
Shapes: decode steps (1 token per request, or 1 + k with k drafts) and a prefill chunk.
The second table builds a step's `SamplingMetadata` for requests with a presence penalty
(300 prompt and 200 output tokens each, vocabulary 49,152), recounting every history as
before or reading the kept tables. Sides run interleaved (A, B, B, A, ...); medians in
microseconds per step.

    python benchmarks/input_batch.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from cluster.engine.messages import ScheduledRequest
from cluster.sample.metadata import SamplingMetadata
from cluster.sampling_params import SamplingParams
from cluster.worker.input_batch import InputBatch
from cluster.worker.penalty_tables import PenaltyTables

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


def interleaved(sides: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median microseconds of each side, run A, B, B, A, ..."""
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def penalty_rows(batch: int, repeats: int) -> str:
    vocab = 49152
    rng = random.Random(0)
    params = [SamplingParams(temperature=0.8, presence_penalty=0.5)] * batch
    prompts = [[rng.randrange(vocab) for _ in range(300)] for _ in range(batch)]
    outputs = [[rng.randrange(vocab) for _ in range(200)] for _ in range(batch)]
    tables = PenaltyTables(vocab, torch.device("cpu"))
    ids = [f"r{i}" for i in range(batch)]
    for req_id, p, prompt, output in zip(ids, params, prompts, outputs, strict=True):
        tables.add(req_id, p, prompt, output)
    kept = (tables.prompt_mask, tables.output_counts, tables.rows(ids))
    sides = {
        "recounted": partial(
            SamplingMetadata.from_params,
            params,
            vocab,
            prompt_token_ids=prompts,
            output_token_ids=outputs,
        ),
        "kept": partial(SamplingMetadata.from_params, params, vocab, penalty_tables=kept),
    }
    t = interleaved(sides, repeats)
    ratio = t["recounted"] / t["kept"]
    return f"| {batch} | {t['recounted']:.0f} | {t['kept']:.0f} | {ratio:.1f}x |"


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
        t = interleaved(
            {
                "rebuilt": partial(rebuilt, scheduled, tables),
                "persistent": partial(batch.prepare, scheduled),
            },
            args.repeats,
        )
        old, new = t["rebuilt"], t["persistent"]
        print(f"| {label} | {old:.0f} | {new:.0f} | {old / new:.2f}x |")
    print("\n| requests with a penalty | recounted every step (us) | kept tables (us) | speed-up |")
    print("|---:|---:|---:|---:|")
    for batch_size in (1, 64):
        print(penalty_rows(batch_size, max(10, args.repeats // 10)))


if __name__ == "__main__":
    main()
