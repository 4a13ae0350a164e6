"""Lossless speculative decoding, the whole path in front of the kernels: argument
checks, `rejection_sample` and the `RejectionSampler` module.

`rejection_sample` verifies drafts against target distributions (Leviathan et al.;
glossary in `cluster/kernels/rejection.py`): it checks its arguments (each error names
the argument), draws the random numbers (none for greedy requests; a seeded request draws
only from its own generator), and runs the Triton kernels or the vectorised torch path
on them (`cluster/kernels/rejection.py`).

`RejectionSampler` sits in front of it. From the target logits at every draft and bonus
position it samples the bonus tokens with the main `Sampler`, processes every draft position
exactly as the `Sampler` would (penalties see the drafts before it; temperature, min-p,
top-k, top-p), takes the softmax, rejection-samples, and returns logprobs for every output
token. A seeded request consumes, in order: the bonus draw (vocab exponentials), then, when
it has drafts, one uniform per draft and vocab exponentials.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from cluster.kernels.backend import use_triton
from cluster.kernels.rejection import PLACEHOLDER_TOKEN_ID, RejectionInputs, run_rejection
from cluster.sample.logprobs import Logprobs, compute_logprobs
from cluster.sample.metadata import SamplingMetadata, SpecDecodeMetadata
from cluster.sample.processing import process_logits, sampling_distribution
from cluster.sample.randomness import draw_inv_exponentials, draw_uniforms
from cluster.sample.sampler import Sampler


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [num_tokens] int64, every request's drafts in order
    num_draft_tokens: Sequence[int],  # [batch], 0 allowed
    draft_probs: torch.Tensor | None,  # [num_tokens, vocab], None when drafts are deltas
    target_probs: torch.Tensor,  # [num_tokens, vocab], constraints already applied
    bonus_token_ids: torch.Tensor,  # [batch] int64
    is_greedy: torch.Tensor,  # [batch] bool
    generators: Mapping[int, torch.Generator] | None = None,
    backend: str = "auto",
    check_values: bool = True,
) -> torch.Tensor:
    """[batch, max(num_draft_tokens) + 1] int64 output tokens, -1 after the last one.

    `backend`: "auto" (Triton for CUDA tensors, torch on CPU), "triton" (on CPU: the Triton
    interpreter, which needs TRITON_INTERPRET=1 before triton is imported) or "torch".
    Probabilities in other float dtypes are converted to float32, int32 ids to int64.
    """
    generators = dict(generators or {})
    check_rejection_args(
        draft_token_ids,
        num_draft_tokens,
        draft_probs,
        target_probs,
        bonus_token_ids,
        is_greedy,
        generators,
        backend,
        check_values,
    )
    device = target_probs.device
    num_draft = list(num_draft_tokens)
    greedy = is_greedy.tolist()
    needs_draws = [not g and n > 0 for g, n in zip(greedy, num_draft, strict=True)]
    uniforms = inv_exponentials = None
    if any(needs_draws):
        vocab = target_probs.shape[1]
        uniforms = draw_uniforms(num_draft, needs_draws, generators, device)
        inv_exponentials = draw_inv_exponentials(needs_draws, generators, vocab, device)
    cu = torch.tensor([0, *num_draft], dtype=torch.int64).cumsum(0).to(device)
    inputs = RejectionInputs(
        draft_token_ids=draft_token_ids.long().contiguous(),
        cu_num_draft_tokens=cu,
        draft_probs=None if draft_probs is None else draft_probs.float().contiguous(),
        target_probs=target_probs.float().contiguous(),
        bonus_token_ids=bonus_token_ids.long().contiguous(),
        is_greedy=is_greedy.contiguous(),
        uniforms=uniforms,
        inv_exponentials=inv_exponentials,
        max_spec_len=max(num_draft, default=0),
    )
    return run_rejection(inputs, backend)


def check_rejection_args(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor,
    generators: Mapping[int, torch.Generator],
    backend: str,
    check_values: bool = True,
) -> None:
    """Raise a ValueError naming the first bad argument; return None when all are usable.
    `check_values=False` skips the scans of the tensors' values (ids in range, finite
    probabilities), which read every value back to the host: the engine builds those
    tensors itself and scans them only with `CLUSTER_DEBUG_CHECKS=1`."""
    _check_tensor("target_probs", target_probs, ndim=2, kind="float")
    use_triton(backend, target_probs.device)  # the one backend check: raises if unusable
    num_tokens, vocab_size = target_probs.shape
    if vocab_size == 0:
        raise ValueError("target_probs must have a non-empty vocabulary dimension")
    device = target_probs.device
    if isinstance(num_draft_tokens, torch.Tensor) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in num_draft_tokens
    ):
        raise ValueError("num_draft_tokens must be a list of ints >= 0, one per request")
    batch = len(num_draft_tokens)

    _check_tensor("draft_token_ids", draft_token_ids, ndim=1, kind="int", device=device)
    if draft_token_ids.shape[0] != sum(num_draft_tokens):
        raise ValueError(
            f"draft_token_ids has {draft_token_ids.shape[0]} entries but num_draft_tokens "
            f"sums to {sum(num_draft_tokens)}"
        )
    if num_tokens != draft_token_ids.shape[0]:
        raise ValueError(
            f"target_probs must have one row per draft token ({draft_token_ids.shape[0]}), got {num_tokens}"
        )
    if draft_probs is not None:
        _check_tensor("draft_probs", draft_probs, ndim=2, kind="float", device=device)
        if draft_probs.shape != target_probs.shape:
            raise ValueError(
                f"draft_probs must have target_probs' shape {tuple(target_probs.shape)}, "
                f"got {tuple(draft_probs.shape)}"
            )
    _check_tensor("bonus_token_ids", bonus_token_ids, ndim=1, kind="int", device=device)
    _check_tensor("is_greedy", is_greedy, ndim=1, kind="bool", device=device)
    for name, t in (("bonus_token_ids", bonus_token_ids), ("is_greedy", is_greedy)):
        if t.shape[0] != batch:
            raise ValueError(f"{name} must have one entry per request ({batch}), got {t.shape[0]}")
    _check_generators(generators, batch, device)
    if not check_values:
        return
    for name, ids in (("draft_token_ids", draft_token_ids), ("bonus_token_ids", bonus_token_ids)):
        if ids.numel() and not bool(((ids >= 0) & (ids < vocab_size)).all()):
            raise ValueError(f"{name} must lie in [0, vocab_size={vocab_size})")
    for name, probs in (("target_probs", target_probs), ("draft_probs", draft_probs)):
        if probs is not None and probs.numel() and not _finite_and_non_negative(probs):
            raise ValueError(f"{name} must be finite and >= 0")


def _finite_and_non_negative(probs: torch.Tensor) -> bool:
    low, high = torch.aminmax(probs)  # one pass; NaN propagates and fails both tests
    return bool((low >= 0) & (high < float("inf")))


def _check_tensor(
    name: str,
    t: object,
    *,
    ndim: int,
    kind: str,
    device: torch.device | None = None,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    dtype_ok = {
        "float": t.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64),
        "int": t.dtype in (torch.int64, torch.int32),
        "bool": t.dtype == torch.bool,
    }[kind]
    if not dtype_ok:
        wanted = {"float": "a floating", "int": "an int64 or int32", "bool": "a bool"}[kind]
        raise ValueError(f"{name} must have {wanted} dtype, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but target_probs is on {device}")


def _check_generators(
    generators: Mapping[int, torch.Generator], batch: int, device: torch.device
) -> None:
    for index, generator in generators.items():
        if not isinstance(index, int) or not 0 <= index < batch:
            raise ValueError(
                f"generators keys must be request indices in [0, {batch}), got {index!r}"
            )
        if not isinstance(generator, torch.Generator):
            raise ValueError(f"generators[{index}] must be a torch.Generator")
        if generator.device.type != device.type:
            raise ValueError(
                f"generators[{index}] is a {generator.device.type} generator but the "
                f"tensors are on {device}"
            )


@dataclass(frozen=True)
class RejectionSamplerOutput:
    token_ids: torch.Tensor  # [batch, max_spec_len + 1] int64, -1 after the last token
    logprobs: Logprobs | None  # [batch, max_spec_len + 1, ...] for every output token

    @property
    def num_output_tokens(self) -> torch.Tensor:  # [batch]: accepted drafts + 1
        return (self.token_ids != PLACEHOLDER_TOKEN_ID).sum(dim=1)


class RejectionSampler(nn.Module):
    """Verifies drafts against the target logits with each request's sampling parameters."""

    def __init__(
        self,
        sampler: Sampler | None = None,
        backend: str = "auto",
        check_values: bool | None = None,
    ) -> None:
        super().__init__()
        self.sampler = Sampler() if sampler is None else sampler
        self.backend = backend
        # Scans of the probabilities' values (a host read each step): a debug aid.
        if check_values is None:
            check_values = os.environ.get("CLUSTER_DEBUG_CHECKS", "0") == "1"
        self.check_values = check_values

    def forward(
        self,
        logits: torch.Tensor,  # [num_logits, vocab]: rows named by `spec`
        spec: SpecDecodeMetadata,
        metadata: SamplingMetadata,
        draft_probs: torch.Tensor | None = None,  # [num_tokens, vocab], None for delta drafts
    ) -> RejectionSamplerOutput:
        """Sample the bonus tokens, verify the drafts, and collect logprobs if asked for."""
        if len(spec.num_draft_tokens) != metadata.batch_size:
            raise ValueError(
                f"spec has {len(spec.num_draft_tokens)} requests but metadata has "
                f"{metadata.batch_size}"
            )
        target_logits = logits.index_select(0, spec.target_logits_indices)  # [num_tokens, vocab]
        bonus_logits = logits.index_select(0, spec.bonus_logits_indices)  # [batch, vocab]
        bonus_rows, draft_rows = spec.bonus_rows(), spec.draft_rows()

        bonus_processed = process_logits(bonus_logits, metadata, bonus_rows)
        bonus_token_ids = self.sampler.sample(bonus_processed, metadata, bonus_rows)
        processed = process_logits(target_logits, metadata, draft_rows)
        greedy_rows = metadata.is_greedy[draft_rows.request_index]
        target_probs = sampling_distribution(processed, greedy_rows)
        token_ids = rejection_sample(
            spec.draft_token_ids,
            spec.num_draft_tokens,
            draft_probs,
            target_probs,
            bonus_token_ids,
            metadata.is_greedy,
            metadata.generators,
            self.backend,
            self.check_values,
        )

        logprobs = None
        if metadata.max_num_logprobs is not None:
            raw = self.sampler.logprobs_mode == "raw"
            sources = (target_logits, bonus_logits) if raw else (processed, bonus_processed)
            logprobs = self._logprobs(torch.cat(sources), token_ids, spec, metadata)
        return RejectionSamplerOutput(token_ids, logprobs)

    def _logprobs(
        self,
        sources: torch.Tensor,  # [num_tokens + batch, vocab]: draft rows, then bonus rows
        token_ids: torch.Tensor,  # [batch, max_spec_len + 1]
        spec: SpecDecodeMetadata,
        metadata: SamplingMetadata,
    ) -> Logprobs:
        """Logprobs of every output token, read at the row that produced it."""
        batch, width = token_ids.shape
        num_tokens = spec.draft_token_ids.shape[0]
        row_of, start = [], 0  # output (i, j) came from draft row start + j or bonus row
        for i, n in enumerate(spec.num_draft_tokens):
            row_of.extend(start + j if j < n else num_tokens + i for j in range(width))
            start += n
        index = torch.tensor(row_of, dtype=torch.int64, device=sources.device)
        requests = [i for i in range(batch) for _ in range(width)]
        wanted = [metadata.num_logprobs[i] for i in requests]
        num = torch.tensor([-1 if n is None else n for n in wanted], device=sources.device)
        flat = compute_logprobs(
            sources.index_select(0, index), token_ids.reshape(-1), num, metadata.max_num_logprobs
        )
        return flat.reshape(batch, width)
