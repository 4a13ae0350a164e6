"""Batch invariance in bfloat16 on the real default model (SmolLM2-135M-Instruct).

With `batch_invariant=True` (the default) a token's logits do not depend on how many other
tokens share its step, so in bfloat16, where a different summation order flips near-tie
argmaxes: a request's greedy answer alone equals its answer inside a batch of 16 (prefix
caching on, so some of them start from another request's cached blocks), a decode step's
logprobs are the same bits alone and in a 16-token step, and greedy speculation (n-gram,
the shipped EAGLE-3 head, an MTP head, a draft tree) equals greedy decoding token for token.
The compiled engine's answers are the eager engine's, token for token (its norms sum in
eager's order, its casts round where eager rounds), and transformers' in bfloat16 up to
the bfloat16 near-tie rule (tests/greedy_reference.py).
"""

import os

import pytest
import torch
from greedy_reference import CHAT_QUESTIONS, assert_greedy_equal, chat_ids, hf_greedy
from random_heads import write_deepseek_mtp

from cluster import LLM, SamplingParams

QUESTIONS = [
    *CHAT_QUESTIONS,
    "Name a famous painting and its painter.",
    "Why is the sky blue?",
    "Give me a word that rhymes with cat.",
    "What do bees make?",
    "Count from one to ten in French.",
    "Write one sentence about the sea.",
    "What is the opposite of hot?",
    "Tell me a fun fact about octopuses.",
]
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE = dict(dtype="bfloat16", max_model_len=192, max_num_seqs=16, num_kv_blocks=256)


def _chats(llm: LLM) -> list[dict]:
    tokenizer = llm.get_tokenizer()
    return [{"prompt_token_ids": chat_ids(tokenizer, q)} for q in QUESTIONS]


@pytest.fixture(scope="module")
def baseline(smollm2_path):
    """(prompts, the batched greedy answers with speculation off)."""
    with LLM(smollm2_path, **ENGINE) as llm:
        assert llm.config.model.batch_invariant
        prompts = _chats(llm)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        return prompts, [o.outputs[0].token_ids for o in outs]


def test_greedy_equals_transformers_in_bfloat16(smollm2_path, baseline):
    from transformers import AutoModelForCausalLM

    prompts, batched = baseline
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.bfloat16).eval()
    for prompt, ours in zip(prompts, batched, strict=True):
        ids = prompt["prompt_token_ids"]
        assert_greedy_equal(hf, ids, ours, hf_greedy(hf, ids, NEW_TOKENS))


def test_a_request_alone_equals_itself_in_a_batch_of_16(smollm2_path, baseline):
    prompts, batched = baseline
    with LLM(smollm2_path, **ENGINE) as llm:
        for i in range(0, len(prompts), 2):  # every other one, each alone
            alone = llm.generate([prompts[i]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            assert alone == batched[i], QUESTIONS[i]


def test_decode_logprobs_are_the_same_bits_alone_and_in_a_16_token_step(smollm2_path, baseline):
    prompts, _ = baseline
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=20)
    with LLM(smollm2_path, **ENGINE, enable_prefix_caching=False) as llm:
        batched = llm.generate(prompts, params, use_tqdm=False)
        for i in (0, 5, 15):
            alone = llm.generate([prompts[i]], params, use_tqdm=False)[0]
            for ours, theirs in zip(
                alone.outputs[0].logprobs, batched[i].outputs[0].logprobs, strict=True
            ):
                # one dict per output token: token id -> Logprob; floats compared exactly
                assert {t: lp.logprob for t, lp in ours.items()} == {
                    t: lp.logprob for t, lp in theirs.items()
                }


def test_float32_engines_are_not_padded(smollm2_path):
    """`batch_invariant=False` is the old engine exactly: the option only adds padding."""
    with LLM(smollm2_path, dtype="float32", max_model_len=64, batch_invariant=False) as llm:
        assert not llm.config.model.batch_invariant
        assert llm.engine.core.executor.worker.runner.min_rows == 1


def _speculative_configs(tmp_path, target: str) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3},
        "eagle3": {"model": "builtin:smollm2-eagle3", "num_speculative_tokens": 3},
        "mtp": {
            "method": "mtp",
            "model": write_deepseek_mtp(os.path.join(tmp_path, "mtp"), target, seed=1),
            "num_speculative_tokens": 3,
        },
        "eagle3_tree": {
            "model": "builtin:smollm2-eagle3",
            "num_speculative_tokens": 3,
            "tree": {"topk": 2, "num_nodes": 6},
        },
    }


@pytest.mark.parametrize("method", ["ngram", "eagle3", "mtp", "eagle3_tree"])
def test_greedy_speculation_equals_greedy_decoding_in_bfloat16(
    smollm2_path, baseline, tmp_path, method
):
    prompts, batched = baseline
    spec = _speculative_configs(str(tmp_path), smollm2_path)[method]
    with LLM(smollm2_path, speculative_config=spec, **ENGINE) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.get_metrics()["num_draft_tokens"] > 0
    got = [o.outputs[0].token_ids for o in outs]
    wrong = [q for q, a, b in zip(QUESTIONS, got, batched, strict=True) if a != b]
    assert not wrong, f"{method}: {len(wrong)} of {len(QUESTIONS)} differ, e.g. {wrong[:2]}"


@pytest.mark.slow
def test_the_compiled_engine_is_batch_invariant_too(smollm2_path, baseline):
    """One graph for every step (a symbolic token count), speculating with n-gram drafts:
    a request alone (decode and verification steps of its own) equals itself in a batch
    of 8 (steps of up to 32 rows, verification and decode rows mixed), and equals the
    eager engine's greedy answers without speculation, token for token."""
    from cluster.models.compiled import CompiledForward

    prompts = baseline[0][:8]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM(smollm2_path, speculative_config=spec, compile="on", **ENGINE) as llm:
        target = llm.engine.core.executor.worker.runner.target_forward
        assert isinstance(target, CompiledForward) and target.options.dynamic
        batched = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.get_metrics()["num_accepted_tokens"] > 0
        assert [o.outputs[0].token_ids for o in batched] == baseline[1][:8]
        for i in (1, 4, 6):
            alone = llm.generate([prompts[i]], GREEDY, use_tqdm=False)[0]
            assert alone.outputs[0].token_ids == batched[i].outputs[0].token_ids, QUESTIONS[i]
        assert target.ready and not target.failed and target.num_guard_misses == 0
