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
from cluster.models.eagle3 import eagle3_aux_layers
from cluster.models.loader import load_model
from cluster.parallel import ParallelState
from cluster.parallel.linear import pack_linears
from cluster.train.answer_store import AnswerStore, Sample, chat_key
from cluster.train.feature_store import has_part, write_part
from cluster.train.prompts import Chat, follow_up_chats

__all__ = [
    "Sample",
    "answer_with_follow_ups",
    "aux_states",
    "cache_features",
    "feature_dirs",
    "generate_answers",
]


def generate_answers(
    target_path: str,
    chats: list[Chat],
    max_tokens: int,
    store_dir: str,
    feature_dirs: tuple[str, str] | None = None,
    max_num_seqs: int = 256,
    chunk: int = 1024,
    dtype: str = "auto",
) -> list[Sample]:
    """Greedy answers of the target to `chats`, in order, stored a chunk at a time in the
    compact `AnswerStore` at `store_dir`: a rerun resumes after the last stored chunk.

    With `feature_dirs` (EAGLE-3 features, final hidden states) the engine runs eagerly
    with a `FeatureRecorder` and writes both feature parts beside each answer part, so no
    second forward is needed. Large batches pay on a CPU: a [256, 576] x [576, 1536]
    matmul runs about 3x the FLOP/s of a [64, ...] one, so 256 sequences decode at once
    (a 4 GiB KV cache)."""
    meta = {"target": os.path.basename(os.path.normpath(target_path)), "max_tokens": max_tokens}
    store = AnswerStore(store_dir, meta)
    keys = [chat_key(c) for c in chats]
    done = store.check_prefix(keys)
    if done < len(chats):
        from cluster.llm import LLM
        from cluster.sampling_params import SamplingParams
        from cluster.train.recorder import FeatureRecorder

        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        hf = ModelConfig(path=target_path).hf_config
        engine: dict = dict(
            dtype=dtype,
            max_model_len=min(2048, int(hf.max_position_embeddings)),
            max_num_seqs=max_num_seqs,
            cpu_kv_cache_gib=4.0,
        )
        if feature_dirs is not None:
            engine.update(compile="off", enable_prefix_caching=False)
        aux = eagle3_aux_layers(int(hf.num_hidden_layers))
        with LLM(target_path, **engine) as llm:
            recorder = FeatureRecorder(llm, aux) if feature_dirs is not None else None
            for start in tqdm(
                range(done, len(chats), chunk),
                desc=f"Answering {len(chats) - done} prompts, {chunk} a part",
            ):
                batch = chats[start : start + chunk]
                # Submitted shortest first, so the sequences decoding together have
                # similar lengths: the CPU attention pads every sequence of a decode
                # batch to the longest one's context.
                order = sorted(range(len(batch)), key=lambda i: _chars(batch[i]))
                answered = llm.chat([list(batch[i]) for i in order], params, use_tqdm=False)
                outputs = [
                    o for _, o in sorted(zip(order, answered, strict=True), key=lambda t: t[0])
                ]
                samples = [
                    Sample(o.prompt_token_ids + o.outputs[0].token_ids, len(o.prompt_token_ids))
                    for o in outputs
                ]
                index = store.num_parts
                store.append(samples, keys[start : start + chunk])
                if recorder is not None:  # a crash before this leaves them to `cache_features`
                    assert feature_dirs is not None
                    rows = [
                        recorder.take(o.request_id, len(s.token_ids))
                        for o, s in zip(outputs, samples, strict=True)
                    ]
                    for kind, feature_dir in enumerate(feature_dirs):
                        write_part(feature_dir, index, samples, [r[kind] for r in rows])
    return store.read()[: len(chats)]


def _chars(chat: Chat) -> int:
    return sum(len(m["content"]) for m in chat)


def feature_dirs(work_dir: str, store: str) -> tuple[str, str]:
    """Where the features of answer store `store` live: (EAGLE-3 aux states, final hidden)."""
    return os.path.join(work_dir, f"features_{store}"), os.path.join(
        work_dir, f"final_hidden_{store}"
    )


def answer_with_follow_ups(
    target_path: str,
    chats: list[Chat],
    max_tokens: int,
    answers_dir: str,
    split: str,
    follow_up_fraction: float,
    seed: int = 0,
    record_in: str | None = None,
) -> list[str]:
    """Answer `chats` (store `answers_dir/split`), then, once all of them are answered,
    follow-up turns after a `follow_up_fraction` of them (store `split_follow_ups`); the
    names of the stores filled. With `record_in` (a work dir), features are recorded
    while answering, into its `feature_dirs`."""

    def record(store: str) -> tuple[str, str] | None:
        return feature_dirs(record_in, store) if record_in else None

    samples = generate_answers(
        target_path, chats, max_tokens, os.path.join(answers_dir, split), record(split)
    )
    if follow_up_fraction <= 0:
        return [split]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_path)
    answered = [
        (chat, tokenizer.decode(s.token_ids[s.answer_start :], skip_special_tokens=True))
        for chat, s in zip(chats, samples, strict=True)
    ]
    follow_ups = follow_up_chats(answered, follow_up_fraction, seed)
    name = f"{split}_follow_ups"
    generate_answers(
        target_path, follow_ups, max_tokens, os.path.join(answers_dir, name), record(name)
    )
    return [split, name]


@torch.inference_mode()
def cache_features(
    target_path: str,
    store_dir: str,
    aux_layers: tuple[int, ...],
    out_dir: str,
    max_batch_tokens: int = 2048,
    dtype: str = "auto",
) -> str:
    """Feature parts (`feature_store`) for every part of the answer store at `store_dir`
    that has none yet: [len, len(aux_layers) * hidden] per sample, or [len, hidden] final
    hidden states when `aux_layers` is empty, in the model's `dtype`. Returns `out_dir`."""
    store = AnswerStore(store_dir)
    model = None
    for index in tqdm(range(store.num_parts), desc="Caching features"):
        samples = store.read_part(index)
        if has_part(out_dir, index, samples):
            continue
        if model is None:
            config = ModelConfig(path=target_path, dtype=dtype)
            model = load_model(config, ParallelState.single(config.resolved_device), False)
            pack_linears(model)
            if aux_layers and hasattr(model.model, "end_layer"):  # later layers add nothing
                model.model.end_layer = min(model.model.end_layer, max(aux_layers) + 1)
        rows = [
            f
            for group in _groups(samples, max_batch_tokens)
            for f in aux_states(model, group, aux_layers)
        ]
        write_part(out_dir, index, samples, rows)
    return out_dir


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


def aux_states(
    model: torch.nn.Module, group: list[Sample], aux_layers: tuple[int, ...]
) -> list[torch.Tensor]:
    """Per sample, [len, len(aux_layers) * hidden] (no `aux_layers`: the final hidden
    state [len, hidden]) in the model's dtype, from one flattened forward."""
    device = next(model.parameters()).device
    lens = [len(s.token_ids) for s in group]
    ids = torch.tensor([t for s in group for t in s.token_ids], device=device)
    meta = AttentionMetadata.for_prefill(lens, device)
    with attention_context(meta):
        out = model(ids, meta.positions, aux_layers)
    rows = out if not aux_layers else torch.cat(out[1], dim=-1)
    return list(rows.cpu().split(lens))
