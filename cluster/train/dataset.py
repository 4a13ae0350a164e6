"""Training data for a draft head: the target's own answers, and its features cached on disk.

1. `generate_answers`: the target answers every prompt with our engine (greedy, the way
   the head will be evaluated), so the head learns the target's own continuations.
2. `cache_features`: one target forward per batch of whole sequences records, at every
   position, what the engine hands the head at inference: the residual streams entering
   the EAGLE-3 layers, or (no `aux_layers`: EAGLE-1, MTP) the final hidden state after
   the target's final norm. Shards of float16 tensors are written to `out_dir`;
   existing shards are reused, so an interrupted run resumes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from tqdm import tqdm

from cluster.config import ModelConfig
from cluster.models.attention import AttentionMetadata, attention_context
from cluster.models.loader import load_model
from cluster.parallel import ParallelState


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]  # prompt + answer
    answer_start: int  # index of the first answer token


def generate_answers(
    target_path: str,
    prompts: list[str],
    max_tokens: int,
    out_file: str,
    max_num_seqs: int = 64,
    chunk: int = 128,
) -> list[Sample]:
    """Greedy chat answers of the target, appended to `out_file` (JSON lines) a chunk of
    prompts at a time, so an interrupted run resumes after the last finished chunk."""
    samples = _read_samples(out_file)
    if len(samples) >= len(prompts):
        return samples[: len(prompts)]
    from cluster.llm import LLM
    from cluster.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    with LLM(target_path, dtype="float32", max_model_len=1024, max_num_seqs=max_num_seqs) as llm:
        for start in tqdm(range(len(samples), len(prompts), chunk), desc="Answering prompts"):
            batch = [[{"role": "user", "content": p}] for p in prompts[start : start + chunk]]
            outputs = llm.chat(batch, params, use_tqdm=False)
            with open(out_file, "a") as f:
                for o in outputs:
                    ids = o.prompt_token_ids + o.outputs[0].token_ids
                    f.write(
                        json.dumps({"token_ids": ids, "answer_start": len(o.prompt_token_ids)})
                        + "\n"
                    )
    return _read_samples(out_file)[: len(prompts)]


def _read_samples(path: str) -> list[Sample]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [Sample(**json.loads(line)) for line in f if line.strip()]


@torch.inference_mode()
def cache_features(
    target_path: str,
    samples: list[Sample],
    aux_layers: tuple[int, ...],
    out_dir: str,
    shard_size: int = 64,
    max_batch_tokens: int = 2048,
) -> list[str]:
    """Write shards `{"token_ids", "answer_start", "features"}` (features: list of
    [len, len(aux_layers) * hidden] float16, or [len, hidden] final hidden states when
    `aux_layers` is empty); returns the shard paths."""
    os.makedirs(out_dir, exist_ok=True)
    model = load_model(
        ModelConfig(path=target_path, dtype="float32"), ParallelState.single(), show_progress=False
    )
    paths = []
    for shard_index, start in enumerate(
        tqdm(range(0, len(samples), shard_size), desc="Caching features")
    ):
        path = os.path.join(out_dir, f"shard_{shard_index:05d}.pt")
        paths.append(path)
        if os.path.isfile(path):
            continue
        shard = samples[start : start + shard_size]
        features = [
            f
            for group in _groups(shard, max_batch_tokens)
            for f in _aux_states(model, group, aux_layers)
        ]
        torch.save(
            {
                "token_ids": [s.token_ids for s in shard],
                "answer_start": [s.answer_start for s in shard],
                "features": features,
            },
            path + ".tmp",
        )
        os.replace(path + ".tmp", path)
    return paths


def _groups(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    """Consecutive samples packed into forwards of at most `max_tokens` tokens."""
    groups: list[list[Sample]] = [[]]
    for sample in samples:
        if (
            groups[-1]
            and sum(len(s.token_ids) for s in groups[-1]) + len(sample.token_ids) > max_tokens
        ):
            groups.append([])
        groups[-1].append(sample)
    return [g for g in groups if g]


def _aux_states(
    model: torch.nn.Module, group: list[Sample], aux_layers: tuple[int, ...]
) -> list[torch.Tensor]:
    """Per sample, [len, len(aux_layers) * hidden] (no `aux_layers`: the final hidden
    state [len, hidden]) float16 from one flattened forward."""
    lens = [len(s.token_ids) for s in group]
    ids = torch.tensor([t for s in group for t in s.token_ids])
    meta = AttentionMetadata.for_prefill(lens)
    with attention_context(meta):
        out = model(ids, meta.positions, aux_layers)
    if not aux_layers:
        return list(out.half().split(lens))
    _, aux = out
    return list(torch.cat(aux, dim=-1).half().split(lens))
