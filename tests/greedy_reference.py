"""transformers' greedy continuations, and the near-tie rule for comparing against them.

A divergence from the reference is accepted only at a proven near-tie: at the first
differing position, the reference's logit for our token must be within `NEAR_TIE` of its
top logit (float32), or, for a bfloat16 reference, within `BF16_NEAR_TIE_ULPS` units in
the last place of the top logit (bfloat16 logits are quantised: near 20 one ulp is
0.125). Anything else fails.
"""

from __future__ import annotations

import torch

NEAR_TIE = 1e-4
BF16_NEAR_TIE_ULPS = 2  # measured: every divergence on 16 chat prompts was at <= 1 ulp

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
        top = logits.max().float()
        gap = (top - logits[a].float()).item()
        allowed = NEAR_TIE
        if logits.dtype == torch.bfloat16:
            ulp = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(top.abs()))
            allowed = BF16_NEAR_TIE_ULPS * ulp.item()
        assert gap <= allowed, (
            f"diverged at output token {i}: ours {a}, reference {b}, gap to the reference's "
            f"top logit {gap:.3g} (allowed {allowed:.3g})"
        )
        return  # past a tie the continuations legitimately differ
