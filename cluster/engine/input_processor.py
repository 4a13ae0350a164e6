"""Validating and tokenizing one request at the edge, before the engine accepts it."""

from __future__ import annotations

from typing import Any

from cluster.sampling_params import SamplingParams, is_valid_unicode

Prompt = str | dict[str, Any]  # text, or {"prompt_token_ids": [...]} (optionally "prompt")


def process_prompt(
    prompt: Prompt, tokenizer: Any, max_model_len: int, vocab_size: int
) -> tuple[str | None, list[int]]:
    """(prompt text or None, prompt token ids); raises ValueError naming what is wrong."""
    if isinstance(prompt, str):
        if not is_valid_unicode(prompt):
            raise ValueError("prompt is not valid Unicode (it holds a lone surrogate)")
        text, ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        if not isinstance(ids, list | tuple) or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        ids = list(ids)
    else:
        raise ValueError('a prompt is a string or {"prompt_token_ids": [...]}')
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) > max_model_len:
        raise ValueError(
            f"the prompt has {len(ids)} tokens, more than max_model_len={max_model_len}"
        )
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt_token_ids hold ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        )
    return text, ids


def check_params(
    params: SamplingParams, vocab_size: int, max_model_len: int, prompt_len: int
) -> SamplingParams:
    """Checks that need the model; fills max_tokens=None with the room left. A prompt plus
    `max_tokens` beyond `max_model_len` is refused, as OpenAI and vLLM do."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    # Validated again: `model_copy(update=...)` skips pydantic's validators.
    params = SamplingParams(**params.model_dump())
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary size {vocab_size}")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids hold ids outside the vocabulary: {bad}")
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias holds token ids outside the vocabulary: {bad[:5]}")
    if params.max_tokens is not None and prompt_len + params.max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens={params.max_tokens} plus the prompt's {prompt_len} tokens is more "
            f"than max_model_len={max_model_len}; ask for at most "
            f"{max_model_len - prompt_len} tokens"
        )
    if params.max_tokens is None:
        params = params.model_copy(update={"max_tokens": max(1, max_model_len - prompt_len)})
    return params
