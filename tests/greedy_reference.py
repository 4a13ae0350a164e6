"""transformers' greedy continuations, and the near-tie rule for comparing against them.

A divergence from the reference is accepted only at a proven near-tie: at the first
differing position the reference's top-2 logit gap must be below `NEAR_TIE` and our
token must be one of those two. Anything else fails.
"""

from __future__ import annotations

import torch

NEAR_TIE = 1e-4

# Chat questions the SmolLM2 tests share.
CHAT_QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain how a bicycle works.",
    "Repeat this: one two three, one two three, one two three.",
    "List three fruits that are red.",
    "What is 12 plus 30?",
    "Describe the colour blue to someone who has never seen it, in two sentences.",
]


@torch.no_grad()
def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of one user turn with the chat template's generation prompt."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    # Like ignore_eos: EOS may be generated but does not stop. (min_new_tokens would forbid
    # EOS instead, and a None in a passed GenerationConfig falls back to the model's EOS.)
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=saved if isinstance(saved, int) else 0,
        )
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt_ids) :].tolist()


@torch.no_grad()
def assert_greedy_equal(
    model, prompt_ids: list[int], ours: list[int], reference: list[int]
) -> None:
    """Token-for-token equality, except after a proven near-tie."""
    assert len(ours) == len(reference), (len(ours), len(reference))
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        if a == b:
            continue
        logits = model(torch.tensor([prompt_ids + reference[:i]])).logits[0, -1]
        top2 = logits.topk(2)
        gap = (top2.values[0] - top2.values[1]).item()
        assert gap < NEAR_TIE and a in top2.indices.tolist(), (
            f"diverged at output token {i}: ours {a}, reference {b}, top-2 gap {gap:.3g}"
        )
        return  # past a tie the continuations legitimately differ
