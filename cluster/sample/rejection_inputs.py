"""Checks on `rejection_sample`'s arguments, run before any kernel so errors name the argument."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

BACKENDS = ("auto", "triton", "torch")


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
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _check_tensor("target_probs", target_probs, ndim=2, kind="float")
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
