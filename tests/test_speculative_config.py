"""SpeculativeConfig: method detection from checkpoints, and clear errors."""

import json
import os
import shutil

import pytest
import torch
from random_heads import write_all
from safetensors.torch import load_file
from tiny_models import make_tiny_chat_model, make_tiny_llama

from cluster import LLM, SamplingParams
from cluster.config import engine_config_from_args
from cluster.config.speculative import SpeculativeConfig
from cluster.spec_decode.ngram import ngram_drafts


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


def _as_bin(head, out, **config_changes):
    """A copy of a head folder with its tensors in pytorch_model.bin (as public heads
    ship), and its config changed."""
    shutil.copytree(head, out)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    os.remove(os.path.join(out, "model.safetensors"))
    torch.save(tensors, os.path.join(out, "pytorch_model.bin"))
    with open(os.path.join(out, "config.json")) as f:
        config = {**json.load(f), **config_changes}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return str(out)


def test_public_bin_heads_are_detected_and_draft_losslessly(setup):
    """EAGLE-1 as published (`.bin`, `architectures: LlamaForCausalLM`), EAGLE-3 and the
    normalised EAGLE as `.bin`: detected by their tensors, loaded, lossless."""
    target, specs, root = setup
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 5, 6]}
    engine = dict(dtype="float32", max_model_len=64, num_kv_blocks=32)
    with LLM(target, **engine) as llm:
        expected = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    for kind, changes in [
        ("eagle", {"architectures": ["LlamaForCausalLM"]}),
        ("eagle3", {}),
        ("eagle_norm_fusion", {}),
    ]:
        head = _as_bin(specs[kind]["model"], root / f"bin_{kind}", **changes)
        cfg = SpeculativeConfig(model=head, num_speculative_tokens=2)
        assert cfg.draft_kind_for(target) == kind
        with LLM(target, speculative_config=cfg.model_dump(), **engine) as llm:
            out = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == expected and out.num_draft_tokens > 0, kind


def test_a_head_with_an_unexpected_tensor_is_refused(setup):
    target, specs, root = setup
    head = _as_bin(specs["eagle"]["model"], root / "extra")
    tensors = torch.load(os.path.join(head, "pytorch_model.bin"), weights_only=True)
    tensors["layers.0.self_attn.rotary_bias"] = torch.zeros(2)
    torch.save(tensors, os.path.join(head, "pytorch_model.bin"))
    spec = {"model": head, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"'layers\.0\.self_attn\.rotary_bias'"):
        LLM(target, dtype="float32", max_model_len=64, speculative_config=spec)


def test_mtp_heads_default_to_the_target_checkpoint(setup):
    target, specs, _ = setup
    cfg = engine_config_from_args(
        specs["mtp_deepseek"]["model"],
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    )
    assert cfg.speculative.draft_path(cfg.model.path) == specs["mtp_deepseek"]["model"]
    with pytest.raises(ValueError, match=r"has no 'mtp' draft"):
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
        (dict(method="ngram", num_speculative_tokens=2, hybrid_lookup_min=2), "draft model"),
        (dict(model="ngram", num_speculative_tokens=2, hybrid_lookup_min=0), "greater than"),
        (dict(method="ngram", num_speculative_tokens=2, min_draft_confidence=0.5), "draft model"),
        (dict(method="ngram", num_speculative_tokens=2, min_draft_confidence=1.0), "less than"),
    ],
)
def test_bad_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)


def test_vllm_keys_and_values_are_accepted_as_they_are(setup):
    """A vLLM speculative_config means the same here (docs/speculative.md's table)."""
    _, specs, _ = setup
    head = specs["eagle3"]["model"]
    ngram = SpeculativeConfig(method="[ngram]", num_speculative_tokens=3)
    assert (ngram.method, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == ("ngram", 5, 5)
    one_end = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3)
    assert (one_end.prompt_lookup_min, one_end.prompt_lookup_max) == (3, 3)
    sampled = SpeculativeConfig(
        model=head, num_speculative_tokens=2, draft_sample_method="probabilistic"
    )
    assert sampled.draft_sampling == "sample"
    tree = SpeculativeConfig(
        model=head,
        num_speculative_tokens=2,
        speculative_token_tree="[(0,), (1,), (0, 0)]",
        draft_tensor_parallel_size=1,
    )
    assert tree.tree is not None and tree.tree.paths == ((0,), (1,), (0, 0))
    for bad, field in [
        ({"draft_sample_method": "beam"}, "draft_sample_method"),
        ({"speculative_token_tree": "[(0,"}, "speculative_token_tree"),
        ({"draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
        ({"suffix_decoding_max_tree_depth": 8}, "suffix_decoding_max_tree_depth"),
        ({"method": "medusa"}, "method"),
    ]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig(**{"model": head, "num_speculative_tokens": 2, **bad})


def test_hybrid_configs_are_checked(setup):
    _, specs, _ = setup
    head = specs["eagle3"]["model"]
    with pytest.raises(ValueError, match="must not exceed prompt_lookup_max=5"):
        SpeculativeConfig(model=head, num_speculative_tokens=2, hybrid_lookup_min=6)
    with pytest.raises(ValueError, match="cannot be combined"):
        SpeculativeConfig(
            model=head,
            num_speculative_tokens=2,
            hybrid_lookup_min=2,
            tree={"topk": 2, "num_nodes": 4},
        )
    with pytest.raises(ValueError, match="own budget"):
        SpeculativeConfig(
            model=head,
            num_speculative_tokens=2,
            min_draft_confidence=0.3,
            tree={"topk": 2, "num_nodes": 4},
        )
    ok = SpeculativeConfig(
        model=head, num_speculative_tokens=2, hybrid_lookup_min=3, min_draft_confidence=0.3
    )
    assert (ok.hybrid_lookup_min, ok.min_draft_confidence) == (3, 0.3)


def test_hybrid_proposer_takes_lookup_drafts_only_where_the_match_is_long():
    """Per request: a suffix of >= min_match tokens seen before -> its continuation (up
    to k tokens, point masses; also where the model drafted none); otherwise the model's
    drafts and probabilities; a request that does not draft this step gets none."""
    from cluster.spec_decode.batch import DraftProposal
    from cluster.spec_decode.hybrid import HybridProposer

    class Model:
        needs_token_history = False

        def propose(self, batch):
            drafts = [[90, 91], [92, 93], [], [], [94]]
            probs = [torch.ones(2, 8), None, None, None, torch.ones(1, 8)]
            return DraftProposal(drafts, probs)

    from types import SimpleNamespace

    batch = SimpleNamespace(
        token_history=[
            [1, 2, 3, 7, 8, 1, 2, 3],  # [1, 2, 3] repeats: lookup drafts [7, 8]
            [1, 2, 5, 1, 2],  # only [1, 2] repeats: below min_match 3
            [4, 5, 6, 4, 5, 6],  # repeats, but the request is mid-prompt: no drafts
            [9, 9, 9, 9],  # [9, 9, 9] repeats at the start: [9] (one token left)
            [3, 4, 5, 6, 3, 4, 5],  # repeats; the model doubted and drafted one token
        ],
        sampled=[True, True, False, True, True],
        num_valid=[1, 1, 3, 1, 1],
        num_drafts=None,
    )

    hybrid = HybridProposer(Model(), k=2, min_match=3, max_n=4)
    out = hybrid.propose(batch)
    assert out.token_ids == [[7, 8], [92, 93], [], [9], [6, 3]]
    assert out.probs[0] is None and out.probs[3] is None and out.probs[4] is None
    assert out.probs[1] is None  # (the model's own: it had none)
    assert (hybrid.num_lookup_drafts, hybrid.num_model_drafts) == (3, 1)
    batch.num_drafts = 0  # the adaptive controller turned drafting off
    assert hybrid.propose(batch).token_ids == [[90, 91], [92, 93], [], [], [94]]
    with pytest.raises(ValueError, match="min_match"):
        HybridProposer(Model(), k=2, min_match=5, max_n=4)


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
