"""Lossless greedy speculation on the real default model (SmolLM2-135M-Instruct).

Every method, with randomly initialised heads, on 8 chat prompts batched: outputs equal
speculation off and transformers'. EAGLE-3 (the default head's method) runs at k = 1, 3,
5, the others at k = 3 (every method runs at every k on the tiny model in
tests/test_spec_decode.py).
"""

import pytest
import torch
from greedy_reference import CHAT_QUESTIONS, assert_greedy_equal, hf_greedy
from random_heads import write_all
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams

NEW_TOKENS = 16
QUESTIONS = CHAT_QUESTIONS
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=160, max_num_seqs=8, num_kv_blocks=128)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2_path):
    specs = write_all(str(tmp_path_factory.mktemp("smol_drafts")), smollm2_path, seed=1)
    with LLM(smollm2_path, **ENGINE) as llm:
        tokenizer = llm.get_tokenizer()
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            for q in QUESTIONS
        ]
        baseline = [
            o.outputs[0].token_ids
            for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False
            )
        ]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    for prompt, ours in zip(prompts, baseline, strict=True):
        assert_greedy_equal(hf, prompt, ours, hf_greedy(hf, prompt, NEW_TOKENS))
    return smollm2_path, specs, prompts, baseline


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [
        "eagle",
        "eagle_norm_fusion",
        "eagle3",
        "mtp_deepseek",
        "mtp_qwen3_next",
        "ngram",
        "draft_model",
    ],
)
def test_lossless_on_smollm2(setup, method):
    path, specs, prompts, baseline = setup
    for k in (1, 3, 5) if method == "eagle3" else (3,):
        with LLM(
            path, speculative_config={**specs[method], "num_speculative_tokens": k}, **ENGINE
        ) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
            assert llm.get_metrics()["num_draft_tokens"] > 0
        assert [o.outputs[0].token_ids for o in outs] == baseline, (method, k)


def test_per_request_drafting_on_smollm2_is_lossless(setup):
    """The shipped EAGLE-3 head with per-request chains (min_draft_confidence) and hybrid
    lookup: fewer drafts per drafting step than k where the head doubts, lookup drafts
    where the answers repeat, the output unchanged."""
    from cluster.config.speculative import builtin_head_path

    path, _, prompts, baseline = setup
    spec = {
        "method": "eagle3",
        "model": builtin_head_path("smollm2-eagle3"),
        "num_speculative_tokens": 4,
        "min_draft_confidence": 0.3,
        "hybrid_lookup_min": 2,
    }
    with LLM(path, speculative_config=spec, **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        metrics = llm.get_metrics()
        proposer = llm.engine.core.executor.worker.runner.proposer
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert 0 < metrics["num_draft_tokens"] < 4 * metrics["num_drafts"]
    assert proposer.num_lookup_drafts > 0 and proposer.num_model_drafts > 0
