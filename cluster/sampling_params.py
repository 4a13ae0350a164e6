"""`SamplingParams`: how one request wants its tokens chosen, validated at the edge.

Field names follow vLLM's so OpenAI-style requests map onto it one to one. The model is
frozen and rejects unknown fields; every bad value raises a pydantic `ValidationError`
(a `ValueError`) whose message names the field and the allowed range.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from cluster.structured_outputs import StructuredOutputsParams

# Temperatures below this are greedy: dividing logits by them would only approximate the
# argmax and risks overflow. This is the single definition the samplers rely on (through
# `SamplingParams.is_greedy`), so no sentinel temperature can drift out of sync.
GREEDY_TEMPERATURE_EPS = 1e-5

_TOP_K_MAX = 2**31 - 1  # larger values mean "no limit" anyway; they could not cross the wire
_LOGIT_BIAS_MAX = 100.0  # OpenAI's range: [-100, 100]
_SEED_MIN = -(2**63)  # torch.Generator.manual_seed accepts [-2**63, 2**64 - 1]
_SEED_MAX = 2**64 - 1
MAX_CHOICES = 128  # OpenAI's limit on `n`


def _require(ok: bool, field: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


def is_valid_unicode(text: str) -> bool:
    """False for strings that cannot be UTF-8 (lone surrogates such as "\\ud800", which
    JSON can carry and tokenizers reject)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _token_id(key: Any) -> int:
    """A token id from an int or a decimal string (JSON object keys are strings)."""
    if isinstance(key, bool) or not isinstance(key, int | str):
        raise TypeError(key)
    return int(key)


class SamplingParams(BaseModel):
    """Sampling parameters of one request (vLLM names). With `n` > 1 the request is `n`
    sequences (`choices()`), each its own engine request."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    # Outputs before which EOS and `stop_token_ids` cannot be sampled (and stop strings
    # are not looked for), as vLLM's `min_tokens`.
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # Logprobs of every prompt token but the first (under the raw logits of the position
    # before it) and this many most likely tokens there; such a request skips the prefix
    # cache, since every prompt position must be computed.
    prompt_logprobs: int | None = None
    # (token id, bias) pairs added to the logits before anything else; the OpenAI form
    # {"token id": bias} is accepted too.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The shape the output must take (JSON schema, regex, choice, grammar): every token
    # the grammar forbids is masked before sampling, at draft positions too.
    structured_outputs: StructuredOutputsParams | None = None

    @field_validator("n")
    @classmethod
    def _check_n(cls, v: int) -> int:
        _require(1 <= v <= MAX_CHOICES, "n", f"an integer in [1, {MAX_CHOICES}]", v)
        return v

    @field_validator("min_tokens")
    @classmethod
    def _check_min_tokens(cls, v: int, info: ValidationInfo) -> int:
        max_tokens = info.data.get("max_tokens")
        allowed = "an integer >= 0" + (
            "" if max_tokens is None else f" and <= max_tokens ({max_tokens})"
        )
        _require(v >= 0 and (max_tokens is None or v <= max_tokens), "min_tokens", allowed, v)
        return v

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, v: float) -> float:
        _require(math.isfinite(v) and v >= 0, "temperature", "a finite number >= 0", v)
        return v

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, v: float) -> float:
        _require(0 < v <= 1, "top_p", "in (0, 1]", v)
        return v

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v: int) -> int:
        ok = v == -1 or 1 <= v <= _TOP_K_MAX
        _require(ok, "top_k", f"-1 (disabled) or an integer in [1, {_TOP_K_MAX}]", v)
        return v

    @field_validator("min_p")
    @classmethod
    def _check_min_p(cls, v: float) -> float:
        _require(0 <= v <= 1, "min_p", "in [0, 1]", v)
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _check_repetition_penalty(cls, v: float) -> float:
        _require(math.isfinite(v) and v > 0, "repetition_penalty", "a finite number > 0", v)
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _check_additive_penalty(cls, v: float, info: ValidationInfo) -> float:
        _require(-2 <= v <= 2, info.field_name, "in [-2, 2]", v)
        return v

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, v: int | None) -> int | None:
        _require(
            v is None or _SEED_MIN <= v <= _SEED_MAX, "seed", "None or in [-2**63, 2**64 - 1]", v
        )
        return v

    @field_validator("max_tokens")
    @classmethod
    def _check_max_tokens(cls, v: int | None) -> int | None:
        _require(v is None or v >= 1, "max_tokens", "None or an integer >= 1", v)
        return v

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _check_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        _require(v is None or v >= 0, info.field_name, "None or an integer >= 0", v)
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, v: Any) -> tuple[str, ...]:
        stops = () if v is None else (v,) if isinstance(v, str) else tuple(v)
        ok = all(isinstance(s, str) and s and is_valid_unicode(s) for s in stops)
        _require(ok, "stop", "a non-empty string or a list of non-empty strings", v)
        return stops

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_logit_bias(cls, v: Any) -> tuple[tuple[int, float], ...]:
        allowed = f'{{"token id": bias}} with biases in [-{_LOGIT_BIAS_MAX:g}, {_LOGIT_BIAS_MAX:g}]'
        if v is None:
            return ()
        pairs = v.items() if isinstance(v, dict) else v
        try:
            out = tuple((_token_id(k), float(b)) for k, b in pairs)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must be {allowed}, got {v!r}") from None
        ok = all(t >= 0 and abs(b) <= _LOGIT_BIAS_MAX for t, b in out)  # NaN fails too
        _require(ok, "logit_bias", allowed, v)
        return out

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _check_stop_token_ids(cls, v: Any) -> tuple[int, ...]:
        ids = () if v is None else tuple(v)
        ok = all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
        _require(ok, "stop_token_ids", "a list of integers >= 0", v)
        return ids

    def choices(self) -> list[SamplingParams]:
        """The parameters of each of the `n` sequences (`n` = 1 each): with a seed,
        sequence i samples with seed + i, as vLLM does."""
        if self.seed is None:
            return [self.model_copy(update={"n": 1})] * self.n
        # (seed + i past the largest seed wraps around to the smallest)
        span = _SEED_MAX - _SEED_MIN + 1
        return [
            self.model_copy(update={"n": 1, "seed": (self.seed + i - _SEED_MIN) % span + _SEED_MIN})
            for i in range(self.n)
        ]

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0, or below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS
