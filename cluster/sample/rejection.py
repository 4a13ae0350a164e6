"""Lossless speculative decoding, the whole path in front of the kernel: argument checks,
`rejection_sample` and the `RejectionSampler` module.

`rejection_sample` verifies chains of drafts against target distributions given a bonus
token per request (Leviathan et al.; glossary in `cluster/kernels/rejection.py`): it checks
its arguments (each error names the argument), draws the random numbers (none for greedy
requests; a seeded request draws only from its own generator: one uniform per draft, then
vocab exponentials), and runs the Triton kernel or the vectorised torch path on them.

`RejectionSampler` verifies draft trees, chains being trees of width one, from the target
logits at every row of each request (its root's, then one per node). It processes every row
exactly as the `Sampler` would at that point of the sequence (penalties and `min_tokens`
see the drafts on the path down to the row; temperature, min-p, top-k, top-p), takes the
softmax, and runs the same kernel: the token after the accepted path (recovered, or the
bonus at a leaf) is drawn there by the same exponential race the `Sampler` runs. It returns
the accepted nodes and logprobs for every output token. A seeded request consumes, in
order: one uniform per draft, then vocab exponentials.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from cluster.kernels.backend import use_triton
from cluster.kernels.rejection import run_rejection
from cluster.kernels.rejection_inputs import RejectionInputs
from cluster.sample.logprobs import Logprobs, compute_logprobs
from cluster.sample.metadata import SamplingMetadata
from cluster.sample.processing import process_logits, sampling_distribution
from cluster.sample.randomness import draw_inv_exponentials, draw_uniforms
from cluster.sample.sampler import Sampler
from cluster.sample.spec_metadata import SpecDecodeMetadata


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
    inputs = RejectionInputs.for_chains(
        num_draft,
        draft_token_ids=draft_token_ids.long().contiguous(),
        target_probs=target_probs.float().contiguous(),
        draft_probs=None if draft_probs is None else draft_probs.float().contiguous(),
        bonus_token_ids=bonus_token_ids.long().contiguous(),
        is_greedy=is_greedy.contiguous(),
        uniforms=uniforms,
        inv_exponentials=inv_exponentials,
    )
    return run_rejection(inputs, backend).token_ids


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
    token_ids: torch.Tensor  # [batch, max_depth + 1] int64, -1 after the last token
    accepted_nodes: torch.Tensor  # [batch, max_depth] int64: node accepted at each depth, or -1
    logprobs: Logprobs | None  # [batch, max_depth + 1, ...] for every output token


class RejectionSampler(nn.Module):
    """Verifies draft trees (and chains) against the target logits with each request's
    sampling parameters."""

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
        logits: torch.Tensor,  # [num_tokens + batch, vocab]: each request's root, then nodes
        spec: SpecDecodeMetadata,
        metadata: SamplingMetadata,
        draft_probs: torch.Tensor | None = None,  # [num_tokens, vocab], None for delta drafts
        has_draft_probs: torch.Tensor | None = None,  # [batch] bool; None: all, if given
    ) -> RejectionSamplerOutput:
        """Verify every request's drafts, draw the token after the accepted path, and
        collect logprobs if asked for."""
        batch = len(spec.num_draft_tokens)
        if batch != metadata.batch_size:
            raise ValueError(f"spec has {batch} requests but metadata has {metadata.batch_size}")
        device = logits.device
        rows = spec.tree_rows()
        if logits.shape[0] != spec.draft_token_ids.shape[0] + batch:
            raise ValueError(
                f"logits must have a row per request and per draft "
                f"({spec.draft_token_ids.shape[0] + batch}), got {logits.shape[0]}"
            )
        processed = process_logits(logits, metadata, rows)
        greedy = metadata.is_greedy
        greedy_list = greedy.tolist()
        # Greedy rows are read only through their argmax: an all-greedy batch skips the softmax.
        all_greedy = all(greedy_list)
        target = (
            processed
            if all_greedy
            else sampling_distribution(processed, greedy[rows.request_index])
        )
        if draft_probs is not None:
            _check_tensor("draft_probs", draft_probs, ndim=2, kind="float", device=device)
            if draft_probs.shape != (spec.draft_token_ids.shape[0], target.shape[1]):
                raise ValueError(
                    f"draft_probs must have one row per draft and the vocabulary, got {tuple(draft_probs.shape)}"
                )
        if self.check_values:  # (greedy-only batches verify logits, which may be -inf)
            vocab = target.shape[1]
            ids = spec.draft_token_ids
            if ids.numel() and not bool(((ids >= 0) & (ids < vocab)).all()):
                raise ValueError(f"draft_token_ids must lie in [0, vocab_size={vocab})")
            checked = (
                (("draft_probs", draft_probs),)
                if all_greedy
                else (("target_probs", target), ("draft_probs", draft_probs))
            )
            for name, probs in checked:
                if probs is not None and probs.numel() and not _finite_and_non_negative(probs):
                    raise ValueError(f"{name} must be finite and >= 0")
        num_draft = list(spec.num_draft_tokens)
        random = [not g for g in greedy_list]
        generators = metadata.generators
        uniforms = inv_exponentials = None
        if not all_greedy:
            needs = [r and n > 0 for r, n in zip(random, num_draft, strict=True)]
            uniforms = draw_uniforms(num_draft, needs, generators, device)
            inv_exponentials = draw_inv_exponentials(random, generators, target.shape[1], device)
        cu = torch.tensor([0, *num_draft], dtype=torch.int64).cumsum(0).to(device)
        parents = [p for tree in spec.parents for p in tree]
        verified = run_rejection(
            RejectionInputs(
                draft_token_ids=spec.draft_token_ids,
                cu_num_draft_tokens=cu,
                draft_parents=torch.tensor(parents, dtype=torch.int64, device=device),
                target_probs=target.float().contiguous(),
                target_row_starts=cu[:-1] + torch.arange(batch, device=device),
                draft_probs=None if draft_probs is None else draft_probs.float().contiguous(),
                has_draft_probs=has_draft_probs,
                bonus_token_ids=None,
                is_greedy=greedy,
                uniforms=uniforms,
                inv_exponentials=inv_exponentials,
                max_depth=spec.max_depth,
                all_chains=not spec.draft_parents,
            ),
            self.backend,
        )
        logprobs = None
        if metadata.max_num_logprobs is not None:
            sources = logits if self.sampler.logprobs_mode == "raw" else processed
            logprobs = _logprobs(sources, verified.token_ids, verified.accepted_nodes, cu, metadata)
        return RejectionSamplerOutput(verified.token_ids, verified.accepted_nodes, logprobs)


def _logprobs(
    sources: torch.Tensor,  # [num_tokens + batch, vocab] raw or processed logits, tree rows
    token_ids: torch.Tensor,  # [batch, width]
    accepted_nodes: torch.Tensor,  # [batch, width - 1]
    cu: torch.Tensor,  # [batch + 1] cumulative drafts
    metadata: SamplingMetadata,
) -> Logprobs:
    """Logprobs of every output token, read at the row that produced it: the root's for the
    first, then each accepted node's for the token after it."""
    batch, width = token_ids.shape
    start = cu[:-1] + torch.arange(batch, device=cu.device)  # [batch] each request's root row
    before = torch.cat([accepted_nodes.new_full((batch, 1), -1), accepted_nodes], 1)[:, :width]
    index = (start[:, None] + before + 1).reshape(-1)  # [batch * width]
    wanted = [metadata.num_logprobs[i] for i in range(batch) for _ in range(width)]
    num = torch.tensor([-1 if n is None else n for n in wanted], device=sources.device)
    flat = compute_logprobs(
        sources.index_select(0, index), token_ids.reshape(-1), num, metadata.max_num_logprobs
    )
    return flat.reshape(batch, width)
