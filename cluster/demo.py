"""`cluster demo`: greedy chat answers from the embedded default model.

Until the engine lands this drives the model directly: every prompt's prefill
and then one decode token per prompt per step go through one flattened forward
over a contiguous KV cache. The command name stays; later it deploys the Serve
application and compares speculation on and off.
"""

from __future__ import annotations

import time

import torch

from cluster.config import ModelConfig
from cluster.models.attention import AttentionMetadata, ContiguousKVCache
from cluster.models.default_model import ensure_default_model
from cluster.models.llama import head_dim_of
from cluster.models.loader import load_model
from cluster.parallel import ParallelState

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Explain what a GPU is in one sentence.",
]


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None
) -> list[list[int]]:
    """Greedy continuations of every prompt, batched in one flattened forward per step."""
    cfg = model.config
    num_kv_heads = model.model.layers[0].self_attn.qkv_proj.num_kv_heads
    max_len = max(len(p) for p in prompts) + max_new_tokens
    cache = ContiguousKVCache(
        cfg.num_hidden_layers,
        len(prompts),
        max_len,
        num_kv_heads,
        head_dim_of(cfg),
        model.lm_head.weight.dtype,
        model.lm_head.weight.device,
    )
    outputs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    new_tokens = [list(p) for p in prompts]  # tokens to compute this step, per prompt
    context = [0] * len(prompts)
    while live:
        starts = [0]
        for i in live:
            starts.append(starts[-1] + len(new_tokens[i]))
        ids = torch.tensor([t for i in live for t in new_tokens[i]])
        positions = torch.cat(
            [torch.arange(context[i], context[i] + len(new_tokens[i])) for i in live]
        )
        seq_lens = [context[i] + len(new_tokens[i]) for i in live]
        meta = AttentionMetadata(starts, seq_lens, positions, cache, cache_slots=live)
        hidden = model(ids, meta)  # [num_tokens, hidden]
        last_rows = torch.tensor(starts[1:]) - 1
        next_ids = model.compute_logits(hidden[last_rows]).argmax(-1).tolist()
        for i, token, seq_len in zip(live, next_ids, seq_lens, strict=True):
            outputs[i].append(token)
            context[i], new_tokens[i] = seq_len, [token]
        live = [
            i for i in live if len(outputs[i]) < max_new_tokens and outputs[i][-1] != eos_token_id
        ]
    return outputs


def run_demo(max_new_tokens: int = 48, prompts: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    path = ensure_default_model()
    config = ModelConfig(path=path, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path)
    model = load_model(config, ParallelState.single())
    prompts = prompts or DEMO_PROMPTS
    token_ids = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for p in prompts
    ]
    start = time.perf_counter()
    outputs = greedy_generate(model, token_ids, max_new_tokens, tokenizer.eos_token_id)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs, strict=True):
        print(f"\n>>> {prompt}\n{tokenizer.decode(out, skip_special_tokens=True).strip()}")
    total = sum(len(o) for o in outputs)
    print(
        f"\n{total} tokens for {len(prompts)} prompts in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s)"
    )
