"""SamplingParams: defaults, normalisation, immutability, and one error per bad value."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.sampling_params import SamplingParams


def test_defaults_are_valid_and_random():
    params = SamplingParams()
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.top_k == -1
    assert params.n == 1 and params.max_tokens == 16 and params.logprobs is None
    assert not params.is_greedy


@pytest.mark.parametrize(("temperature", "greedy"), [(0.0, True), (1e-6, True), (1e-5, False)])
def test_is_greedy_follows_temperature(temperature, greedy):
    assert SamplingParams(temperature=temperature).is_greedy is greedy


def test_stop_and_stop_token_ids_are_normalised_to_tuples():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=[2, 7]).stop_token_ids == (2, 7)


def test_valid_edge_values_are_accepted():
    params = SamplingParams(
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        seed=2**64 - 1,
        max_tokens=None,
        logprobs=0,
        ignore_eos=True,
    )
    assert params.logprobs == 0 and params.seed == 2**64 - 1 and params.max_tokens is None


def test_params_are_frozen():
    params = SamplingParams()
    with pytest.raises(ValidationError, match="frozen"):
        params.temperature = 0.5


def test_unknown_fields_are_rejected():
    with pytest.raises(ValidationError, match="best_of"):
        SamplingParams(best_of=2)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("n", 0, "an integer in [1, 128]"),
        ("n", 129, "an integer in [1, 128]"),
        ("temperature", -0.1, "a finite number >= 0"),
        ("temperature", float("nan"), "a finite number >= 0"),
        ("temperature", float("inf"), "a finite number >= 0"),
        ("top_p", 0.0, "in (0, 1]"),
        ("top_p", 1.01, "in (0, 1]"),
        ("top_k", 0, "-1 (disabled) or an integer in [1, 2147483647]"),
        ("top_k", -2, "-1 (disabled) or an integer in [1, 2147483647]"),
        ("top_k", 10**30, "-1 (disabled) or an integer in [1, 2147483647]"),
        ("min_p", -0.01, "in [0, 1]"),
        ("min_p", 1.5, "in [0, 1]"),
        ("repetition_penalty", 0.0, "a finite number > 0"),
        ("presence_penalty", 2.5, "in [-2, 2]"),
        ("frequency_penalty", -2.5, "in [-2, 2]"),
        ("frequency_penalty", float("nan"), "in [-2, 2]"),
        ("seed", 2**64, "None or in [-2**63, 2**64 - 1]"),
        ("max_tokens", 0, "None or an integer >= 1"),
        ("logprobs", -1, "None or an integer >= 0"),
        ("stop", [""], "a non-empty string or a list of non-empty strings"),
        ("stop", ["ok", 3], "a non-empty string or a list of non-empty strings"),
        ("stop", ["\ud800"], "a non-empty string or a list of non-empty strings"),
        ("stop_token_ids", [1, -1], "a list of integers >= 0"),
        ("logit_bias", {"5": 101}, '{"token id": bias} with biases in [-100, 100]'),
        ("logit_bias", {"five": 1}, '{"token id": bias} with biases in [-100, 100]'),
        ("logit_bias", {"-1": 1}, '{"token id": bias} with biases in [-100, 100]'),
        ("logit_bias", {"5": float("nan")}, '{"token id": bias} with biases in [-100, 100]'),
    ],
)
def test_bad_value_names_field_and_range(field, value, allowed):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert f"{field} must be {allowed}" in message
    assert message.splitlines()[1] == field  # pydantic's location line: the field itself


def test_wrong_type_names_the_field():
    with pytest.raises(ValidationError) as info:
        SamplingParams(top_k=2.5)
    assert info.value.errors()[0]["loc"] == ("top_k",)


def test_choices_are_single_sequences_seeded_one_apart():
    params = SamplingParams(n=3, seed=2**64 - 2, temperature=0.7)
    choices = params.choices()
    assert [c.n for c in choices] == [1, 1, 1]
    assert [c.seed for c in choices] == [2**64 - 2, 2**64 - 1, -(2**63)]  # wraps around
    assert all(c.temperature == 0.7 for c in choices)
    assert [c.seed for c in SamplingParams(n=2).choices()] == [None, None]
