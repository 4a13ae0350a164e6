"""`rejection_sample` checks its arguments before any kernel runs, naming the bad one."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the Triton kernels then run under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from cluster.sample.rejection import rejection_sample

VOCAB = 8


def valid_args() -> dict:
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, VOCAB, generator=gen), dim=1)
    return {
        "draft_token_ids": torch.tensor([1, 2, 3]),
        "num_draft_tokens": [2, 0, 1],
        "draft_probs": probs.flip(1).contiguous(),
        "target_probs": probs,
        "bonus_token_ids": torch.tensor([4, 5, 6]),
        "is_greedy": torch.tensor([False, True, False]),
        "generators": {0: torch.Generator().manual_seed(1)},
        "backend": "torch",
    }


def with_nan(t: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    t = t.clone()
    t[1, 3] = value
    return t


BAD = [
    (
        "draft_token_ids",
        lambda a: a["draft_token_ids"].float(),
        "draft_token_ids must have an int64",
    ),
    ("draft_token_ids", lambda a: a["draft_token_ids"][None], "draft_token_ids must be 1-D"),
    ("draft_token_ids", lambda a: torch.tensor([1, 2, VOCAB]), r"draft_token_ids must lie in \[0"),
    ("draft_token_ids", lambda a: torch.tensor([1, -1, 3]), r"draft_token_ids must lie in \[0"),
    ("draft_token_ids", lambda a: [1, 2, 3], "draft_token_ids must be a torch.Tensor"),
    ("draft_token_ids", lambda a: a["draft_token_ids"].to("meta"), "draft_token_ids is on meta"),
    ("num_draft_tokens", lambda a: [2, 0, 2], "num_draft_tokens sums to 4"),
    ("num_draft_tokens", lambda a: [2, -1, 2], "num_draft_tokens must be a list of ints >= 0"),
    ("num_draft_tokens", lambda a: [2.0, 0, 1], "num_draft_tokens must be a list of ints >= 0"),
    ("num_draft_tokens", lambda a: torch.tensor([2, 0, 1]), "num_draft_tokens must be a list"),
    ("draft_probs", lambda a: a["draft_probs"][:, :5], "draft_probs must have target_probs' shape"),
    ("draft_probs", lambda a: with_nan(a["draft_probs"]), "draft_probs must be finite and >= 0"),
    ("draft_probs", lambda a: with_nan(a["draft_probs"], -0.1), "draft_probs must be finite"),
    ("draft_probs", lambda a: a["draft_probs"].long(), "draft_probs must have a floating dtype"),
    ("target_probs", lambda a: a["target_probs"][0], "target_probs must be 2-D"),
    ("target_probs", lambda a: with_nan(a["target_probs"]), "target_probs must be finite"),
    ("target_probs", lambda a: with_nan(a["target_probs"], float("inf")), "target_probs must be"),
    ("target_probs", lambda a: a["target_probs"][:2], "target_probs must have one row per draft"),
    ("target_probs", lambda a: a["target_probs"][:, :0], "target_probs must have a non-empty"),
    ("bonus_token_ids", lambda a: a["bonus_token_ids"][:2], "bonus_token_ids must have one entry"),
    ("bonus_token_ids", lambda a: torch.tensor([4, 5, 99]), r"bonus_token_ids must lie in \[0"),
    ("is_greedy", lambda a: a["is_greedy"].int(), "is_greedy must have a bool dtype"),
    ("is_greedy", lambda a: a["is_greedy"][:1], "is_greedy must have one entry per request"),
    ("generators", lambda a: {3: torch.Generator()}, r"generators keys must be request indices"),
    ("generators", lambda a: {0: 7}, r"generators\[0\] must be a torch.Generator"),
    ("backend", lambda a: "cuda", "backend must be one of"),
]


@pytest.mark.parametrize(("name", "make_bad", "message"), BAD, ids=[b[2][:40] for b in BAD])
def test_bad_argument_raises_value_error_naming_it(name, make_bad, message):
    args = valid_args()
    args[name] = make_bad(args)
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match=message):
        rejection_sample(**args)
    assert torch.equal(torch.get_rng_state(), state)  # raised before drawing anything


def test_valid_arguments_pass_and_narrow_dtypes_are_accepted():
    args = valid_args()
    out = rejection_sample(**args)
    assert out.shape == (3, 3) and out.dtype == torch.int64
    args["draft_token_ids"] = args["draft_token_ids"].int()
    args["bonus_token_ids"] = args["bonus_token_ids"].int()
    args["target_probs"] = args["target_probs"].half()
    args["generators"] = {0: torch.Generator().manual_seed(1)}
    narrow = rejection_sample(**args)
    assert narrow.dtype == torch.int64 and narrow.shape == (3, 3)


def test_generator_on_another_device_type_is_rejected():
    args = {
        name: value.to("meta") if isinstance(value, torch.Tensor) else value
        for name, value in valid_args().items()
    }  # tensors on the meta device, generator on the CPU
    with pytest.raises(ValueError, match=r"generators\[0\] is a cpu generator"):
        rejection_sample(**args)
