"""Training data for a draft head: the target's own answers, and its features cached on disk.

1. `generate_answers`: the target answers every chat with our engine (greedy, the way
   the head will be evaluated, continuous batching), so the head learns the target's own
   continuations; answers go to a compact, resumable `AnswerStore`.
2. `cache_features`: one target forward per batch of whole sequences records, at every
   position, what the engine hands the head at inference: the residual streams entering
   the EAGLE-3 layers, or (no `aux_layers`: EAGLE-1, MTP) the final hidden state after
   the target's final norm. Shards of float16 tensors are written to `out_dir`;
   existing shards are reused, so an interrupted run resumes.
"""

from __future__ import annotations

import os

import torch
from tqdm import tqdm

from cluster.config import ModelConfig
from cluster.models.attention import AttentionMetadata, attention_context
from cluster.models.loader import load_model
from cluster.parallel import ParallelState
from cluster.train.answer_store import AnswerStore, Sample, chat_key
from cluster.train.prompts import Chat, follow_up_chats

__all__ = ["Sample", "answer_with_follow_ups", "cache_features", "generate_answers"]


def generate_answers(
    target_path: str,
    chats: list[Chat],
    max_tokens: int,
    store_dir: str,
    max_num_seqs: int = 256,
    chunk: int = 1024,
) -> list[Sample]:
    """Greedy answers of the target to `chats`, in order, stored a chunk at a time in the
    compact `AnswerStore` at `store_dir`: a rerun resumes after the last stored chunk.
    Large batches pay on a CPU: a [256, 576] x [576, 1536] matmul runs about 3x the
    FLOP/s of a [64, ...] one, so 256 sequences decode at once (a 4 GiB KV cache)."""
    store = AnswerStore(
        store_dir, {"target": os.path.basename(target_path), "max_tokens": max_tokens}
    )
    keys = [chat_key(c) for c in chats]
    done = store.check_prefix(keys)
    if done < len(chats):
        from cluster.llm import LLM
        from cluster.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        hf = ModelConfig(path=target_path, dtype="float32").hf_config
        max_len = min(2048, int(hf.max_position_embeddings))
        with LLM(
            target_path,
            dtype="float32",
            max_model_len=max_len,
            max_num_seqs=max_num_seqs,
            cpu_kv_cache_gib=4.0,
        ) as llm:
            for start in tqdm(
                range(done, len(chats), chunk),
                desc=f"Answering {len(chats) - done} prompts, {chunk} a part",
            ):
                batch = chats[start : start + chunk]
                outputs = llm.chat([list(c) for c in batch], params, use_tqdm=False)
                samples = [
                    Sample(o.prompt_token_ids + o.outputs[0].token_ids, len(o.prompt_token_ids))
                    for o in outputs
                ]
                store.append(samples, keys[start : start + chunk])
    return store.read()[: len(chats)]


def answer_with_follow_ups(
    target_path: str,
    chats: list[Chat],
    max_tokens: int,
    answers_dir: str,
    split: str,
    follow_up_fraction: float,
    seed: int = 0,
) -> list[Sample]:
    """The answers to `chats` (store `answers_dir/split`), then, once all of them exist,
    the answers to follow-up turns after a `follow_up_fraction` of them (store
    `answers_dir/split_follow_ups`): first-turn samples, then the follow-ups'."""
    samples = generate_answers(target_path, chats, max_tokens, os.path.join(answers_dir, split))
    if follow_up_fraction <= 0:
        return samples
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_path)
    answered = [
        (chat, tokenizer.decode(s.token_ids[s.answer_start :], skip_special_tokens=True))
        for chat, s in zip(chats, samples, strict=True)
    ]
    follow_ups = follow_up_chats(answered, follow_up_fraction, seed)
    store = os.path.join(answers_dir, f"{split}_follow_ups")
    return samples + generate_answers(target_path, follow_ups, max_tokens, store)


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
