"""The batch as the samplers see it: `SamplingMetadata` (every request's `SamplingParams`
as tensors, plus what the penalties need) and `LogitsRows` / `SpecDecodeMetadata` (which
request each logits row belongs to, and the speculative layout of the rows).

Metadata is built once per step from every request's params, its generator and, for
penalties, either its prompt and output token ids or the statistics a worker keeps
between steps (`worker/penalty_tables.py`). Greedy requests get neutral filter values
(temperature 1, no top-k / top-p / min-p), so no sentinel temperature is ever divided
by; `is_greedy` alone marks them.

Plain decoding samples one row per request. With speculation a request with `n` drafts
has `n + 1` logits rows: row `j < n` verifies draft `j` and is processed as if drafts
`0 .. j-1` were already output (its penalties see them); row `n` is the bonus position
and sees all `n` drafts. `LogitsRows` carries exactly that: the request of each row and
the extra (row, token) history pairs that penalties must count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from cluster.sampling_params import SamplingParams

_FLOAT32_SAFE = 1e30  # well inside float32's range (3.4e38), its reciprocal too


@dataclass(frozen=True)
class Penalties:
    """Repetition / presence / frequency penalties of a batch (rows of unpenalised requests
    hold neutral values and zero statistics)."""

    repetition: torch.Tensor  # [batch] float32, 1 = off
    presence: torch.Tensor  # [batch] float32, 0 = off
    frequency: torch.Tensor  # [batch] float32, 0 = off
    active: torch.Tensor  # [batch] bool: the request uses at least one penalty
    # Per table row (a worker keeps these between steps: `worker/penalty_tables.py`):
    prompt_mask: torch.Tensor  # [table_rows, vocab] bool: the token occurs in the prompt
    output_counts: torch.Tensor  # [table_rows, vocab] int32: occurrences in the output so far
    table_rows: torch.Tensor  # [batch] int64: each request's row of the two tables


@dataclass(frozen=True)
class MinTokens:
    """Stop tokens kept out of requests that have fewer than `min_tokens` outputs."""

    stop_mask: torch.Tensor  # [batch, vocab] bool: EOS (unless ignored) and stop_token_ids
    remaining: torch.Tensor  # [batch] int64: outputs still to come before a stop may


@dataclass(frozen=True)
class SamplingMetadata:
    """Every request's sampling parameters, vectorised over the batch."""

    vocab_size: int
    greedy: tuple[bool, ...]  # host copy of is_greedy
    is_greedy: torch.Tensor  # [batch] bool
    temperature: torch.Tensor  # [batch] float32, 1.0 for greedy requests
    top_k: torch.Tensor | None  # [batch] int64, vocab_size = off; None when nobody uses it
    top_p: torch.Tensor | None  # [batch] float32, 1.0 = off; None when nobody uses it
    min_p: torch.Tensor | None  # [batch] float32, 0.0 = off; None when nobody uses it
    penalties: Penalties | None
    logit_bias: torch.Tensor | None  # [batch, vocab] float32 added first; None when unused
    min_tokens: MinTokens | None  # None when no request still needs outputs before a stop
    num_logprobs: tuple[int | None, ...]  # per request: top-n logprobs wanted, None = none
    generators: Mapping[int, torch.Generator]  # request index -> its own generator

    @property
    def batch_size(self) -> int:
        return len(self.greedy)

    @property
    def all_greedy(self) -> bool:
        return all(self.greedy)

    @property
    def max_num_logprobs(self) -> int | None:
        wanted = [n for n in self.num_logprobs if n is not None]
        return max(wanted) if wanted else None

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: torch.device | str = "cpu",
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        generators: Mapping[int, torch.Generator] | None = None,
        eos_token_ids: Sequence[int | None] | None = None,
        penalty_tables: tuple[torch.Tensor, torch.Tensor, Sequence[int]] | None = None,
    ) -> SamplingMetadata:
        """Vectorise `params`; token ids are needed only for requests that use penalties
        or `min_tokens` (which also needs each request's `eos_token_ids`). Penalties read
        `penalty_tables` instead of the token ids when given: (prompt mask, output
        counts, each request's row of them), as a worker keeps them between steps.

        `generators` must hold one generator per seeded random request (the model runner
        keeps them across steps, so a seeded request continues its own stream).
        """
        device = torch.device(device)
        generators = dict(generators or {})
        for i, p in enumerate(params):
            if p.seed is not None and not p.is_greedy and i not in generators:
                raise ValueError(f"generators: request {i} has seed={p.seed} but no generator")
            if p.logprobs is not None and p.logprobs > vocab_size:
                raise ValueError(f"params[{i}].logprobs must be <= vocab_size ({vocab_size})")
        greedy = tuple(p.is_greedy for p in params)

        def column(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        def filter_column(
            values: list[float], off: float, dtype: torch.dtype
        ) -> torch.Tensor | None:
            values = [off if g else v for v, g in zip(values, greedy, strict=True)]
            return column(values, dtype) if any(v != off for v in values) else None

        top_k = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
        # Extreme but legal values are kept inside float32 (1e308 would become inf, and
        # -inf / inf is NaN): a temperature of 1e30 already flattens any logits.
        temperature = [1.0 if p.is_greedy else min(p.temperature, _FLOAT32_SAFE) for p in params]
        return cls(
            vocab_size=vocab_size,
            greedy=greedy,
            is_greedy=column(greedy, torch.bool),
            temperature=column(temperature, torch.float32),
            top_k=filter_column(top_k, vocab_size, torch.int64),
            top_p=filter_column([p.top_p for p in params], 1.0, torch.float32),
            min_p=filter_column([p.min_p for p in params], 0.0, torch.float32),
            penalties=_penalties(
                params, vocab_size, device, prompt_token_ids, output_token_ids, penalty_tables
            ),
            logit_bias=_logit_bias(params, vocab_size, device),
            min_tokens=_min_tokens(params, vocab_size, device, output_token_ids, eos_token_ids),
            num_logprobs=tuple(p.logprobs for p in params),
            generators=MappingProxyType(generators),
        )


def _logit_bias(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """[batch, vocab] float32 biases (one scatter, on the device), or None when unused."""
    pairs = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    if not pairs:
        return None
    rows, tokens, biases = zip(*pairs, strict=True)
    if not all(0 <= t < vocab_size for t in tokens):
        raise ValueError(f"logit_bias token ids must lie in [0, {vocab_size})")
    table = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)
    index = torch.tensor([rows, tokens], dtype=torch.int64, device=device)
    table[index[0], index[1]] = torch.tensor(biases, dtype=torch.float32, device=device)
    return table


def _min_tokens(
    params: Sequence[SamplingParams],
    vocab_size: int,
    device: torch.device,
    output_token_ids: Sequence[Sequence[int]] | None,
    eos_token_ids: Sequence[int | None] | None,
) -> MinTokens | None:
    remaining = [
        max(0, p.min_tokens - (len(output_token_ids[i]) if output_token_ids else 0))
        for i, p in enumerate(params)
    ]
    stops = []
    for i, p in enumerate(params):
        eos = eos_token_ids[i] if eos_token_ids and not p.ignore_eos else None
        ids = [*p.stop_token_ids, *([] if eos is None else [eos])]
        stops.append([t for t in ids if t < vocab_size] if remaining[i] else [])
    if not any(stops):
        return None
    rows = [i for i, ids in enumerate(stops) for _ in ids]
    cols = [t for ids in stops for t in ids]
    mask = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
    mask[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = True
    return MinTokens(mask, torch.tensor(remaining, dtype=torch.int64, device=device))


def uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _penalties(
    params: Sequence[SamplingParams],
    vocab_size: int,
    device: torch.device,
    prompt_token_ids: Sequence[Sequence[int]] | None,
    output_token_ids: Sequence[Sequence[int]] | None,
    tables: tuple[torch.Tensor, torch.Tensor, Sequence[int]] | None,
) -> Penalties | None:
    active = [uses_penalties(p) for p in params]
    if not any(active):
        return None
    if tables is not None:
        prompt_mask, output_counts, rows = tables
        table_rows = torch.tensor(rows, dtype=torch.int64, device=device)
    else:
        for name, ids in (
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
        ):
            if ids is None or len(ids) != len(params):
                raise ValueError(f"{name}: one list per request is needed when penalties are used")
        prompt_mask = (
            _token_table(prompt_token_ids, active, vocab_size, device, "prompt_token_ids") > 0
        )
        output_counts = _token_table(
            output_token_ids, active, vocab_size, device, "output_token_ids"
        )
        table_rows = torch.arange(len(params), device=device)

    def column(values: Sequence[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    # A penalty far from 1 is clamped into [1e-30, 1e30]: float32 keeps it finite and
    # nonzero, and the effect is the same (the token's logit is pushed to the extreme).
    repetition = [min(max(p.repetition_penalty, 1 / _FLOAT32_SAFE), _FLOAT32_SAFE) for p in params]
    return Penalties(
        repetition=column(repetition),
        presence=column([p.presence_penalty for p in params]),
        frequency=column([p.frequency_penalty for p in params]),
        active=torch.tensor(active, dtype=torch.bool, device=device),
        prompt_mask=prompt_mask,
        output_counts=output_counts,
        table_rows=table_rows,
    )


def _token_table(
    token_ids: Sequence[Sequence[int]],
    active: list[bool],
    vocab_size: int,
    device: torch.device,
    name: str,
) -> torch.Tensor:
    """[batch, vocab] int32: how often each active request's `token_ids` hold each token."""
    rows = [i for i, a in enumerate(active) if a for _ in token_ids[i]]
    ids = [t for i, a in enumerate(active) if a for t in token_ids[i]]
    if any(not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"{name} must lie in [0, {vocab_size})")
    table = torch.zeros(len(active), vocab_size, dtype=torch.int32, device=device)
    index = torch.tensor([rows, ids], dtype=torch.int64, device=device).reshape(2, -1)
    ones = torch.ones(len(ids), dtype=torch.int32, device=device)
    return table.index_put_((index[0], index[1]), ones, accumulate=True)


@dataclass(frozen=True)
class LogitsRows:
    """Row -> request map, plus history tokens each row sees beyond its request's output."""

    requests: tuple[int, ...]  # host copy of request_index
    request_index: torch.Tensor  # [rows] int64
    history_rows: torch.Tensor  # [pairs] int64: the row that also sees ...
    history_tokens: torch.Tensor  # [pairs] int64: ... this token as already output

    @property
    def num_rows(self) -> int:
        return len(self.requests)

    @classmethod
    def one_per_request(cls, batch_size: int, device: torch.device | str) -> LogitsRows:
        """Plain decoding: row i samples for request i and sees nothing extra."""
        none = torch.zeros(0, dtype=torch.int64, device=device)
        index = torch.arange(batch_size, device=device)
        return cls(tuple(range(batch_size)), index, none, none)
