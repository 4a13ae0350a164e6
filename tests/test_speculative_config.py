"""SpeculativeConfig: method detection from checkpoints, and clear errors."""

import pytest
from tiny_models import make_tiny_chat_model, make_tiny_llama

from cluster.config import engine_config_from_args
from cluster.spec_decode.ngram import ngram_drafts
from cluster.spec_decode.random_heads import write_all
from cluster.speculative_config import SpeculativeConfig


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("speccfg")
    target = str(root / "target")
    make_tiny_chat_model(target, smollm2_path, num_hidden_layers=4)
    return target, write_all(str(root / "d"), target), root


def test_method_is_detected_from_the_checkpoint(setup):
    target, specs, _ = setup
    expected = {
        "eagle": "eagle",
        "eagle_norm_fusion": "eagle",
        "eagle3": "eagle3",
        "mtp_deepseek": "mtp",
        "mtp_qwen3_next": "mtp",
        "draft_model": "draft_model",
    }
    for name, method in expected.items():
        cfg = SpeculativeConfig(model=specs[name]["model"], num_speculative_tokens=2)
        assert cfg.resolved_method == method, name
        assert cfg.draft_kind_for(target) == name
    assert SpeculativeConfig(model="ngram", num_speculative_tokens=2).resolved_method == "ngram"


def test_mtp_heads_default_to_the_target_checkpoint(setup):
    target, specs, _ = setup
    cfg = engine_config_from_args(
        specs["mtp_deepseek"]["model"],
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    )
    assert cfg.speculative.draft_path(cfg.model.path) == specs["mtp_deepseek"]["model"]
    with pytest.raises(ValueError, match="has no MTP heads"):
        engine_config_from_args(
            target, speculative_config={"method": "mtp", "num_speculative_tokens": 1}
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(num_speculative_tokens=2), "speculative.method or speculative.model is required"),
        (dict(method="eagle", num_speculative_tokens=2), "speculative.model is required"),
        (
            dict(
                method="ngram", num_speculative_tokens=2, prompt_lookup_min=5, prompt_lookup_max=2
            ),
            "must not exceed",
        ),
        (
            dict(method="eagle", model="/nonexistent", num_speculative_tokens=2),
            "not a folder with config.json",
        ),
        (dict(method="ngram", num_speculative_tokens=2, nonsense=1), "nonsense"),
    ],
)
def test_bad_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)


def test_method_must_match_the_checkpoint(setup):
    _, specs, _ = setup
    with pytest.raises(ValueError, match="holds a 'eagle3' draft"):
        SpeculativeConfig(method="eagle", model=specs["eagle3"]["model"], num_speculative_tokens=2)


def test_draft_must_fit_the_target(setup):
    _target, specs, root = setup
    other = str(root / "other")
    make_tiny_llama(other, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="hidden_size=64 differs from the target's hidden_size=32"):
        engine_config_from_args(
            other,
            speculative_config={"model": specs["eagle"]["model"], "num_speculative_tokens": 2},
        )
    with pytest.raises(
        ValueError, match="vocab_size=49152 differs from the target's vocab_size=251"
    ):
        engine_config_from_args(
            other,
            speculative_config={
                "model": specs["draft_model"]["model"],
                "num_speculative_tokens": 2,
            },
        )


def test_ngram_drafts():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 4, 5, 7, 1, 2, 3]
    # suffix [1, 2, 3] occurs at 0 and 5; the earliest wins: what followed it was [4, 9, 1]
    assert ngram_drafts(tokens, 1, 3, 3) == [4, 9, 1]
    assert ngram_drafts(tokens, 1, 3, 10) == [4, 9, 1, 2, 3, 4, 5, 7, 1, 2]
    assert ngram_drafts([5, 6, 7, 8], 1, 3, 3) == []  # nothing repeats
    assert ngram_drafts([4, 8, 4], 2, 3, 2) == []  # only a 1-gram repeats, min_n = 2
    assert ngram_drafts([4, 8, 4], 1, 3, 2) == [8, 4]
