"""Greedy parity of the engine with transformers' generate on the converted SmolLM2.

8 chat prompts of different lengths, float32, 64 new tokens with ignore_eos: each prompt
alone, all together in one continuously batched run, and again with a block size of 4
and a KV budget small enough to force preemption. A divergence is accepted only at a
proven near-tie (tests/greedy_reference.py).
"""

import pytest
import torch
from block_checks import assert_no_block_leaks
from greedy_reference import assert_greedy_equal, hf_greedy
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams

NEW_TOKENS = 64
QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Write a short poem about the ocean at night, with rhymes.",
    "Explain, step by step, how to make a cup of tea.",
    "List five animals that live in the Arctic and one fact about each of them.",
    "Translate to Spanish: The weather is lovely today and we are going to the beach.",
    "What is 17 times 23?",
    "Summarize the plot of a story where a robot learns to paint, in three sentences, "
    "for a child who is six years old and loves colours.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(smollm2_path):
    with LLM(smollm2_path, dtype="float32", max_model_len=256, max_num_seqs=16) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(llm):
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def references(hf_model, prompts):
    return [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]


def _check(hf_model, prompts, outputs, references):
    assert len({len(p) for p in prompts}) == len(prompts)  # different lengths
    for prompt, out, ref in zip(prompts, outputs, references, strict=True):
        assert out.outputs[0].finish_reason == "length"
        assert_greedy_equal(hf_model, prompt, out.outputs[0].token_ids, ref)


def test_each_prompt_alone(llm, hf_model, prompts, references):
    alone = prompts[:3]  # the batched test below runs all of them
    outputs = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0] for p in alone]
    _check(hf_model, alone, outputs, references[:3])


def test_all_prompts_batched(llm, hf_model, prompts, references):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    _check(hf_model, prompts, outputs, references)
    core = llm.engine.core
    assert_no_block_leaks(core.block_manager)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_small_blocks_chunked_prefill_and_preemption(smollm2_path, hf_model, prompts, references):
    # 48 blocks of 4 tokens hold 192 tokens; the 8 requests need far more at once.
    with LLM(
        smollm2_path,
        dtype="float32",
        max_model_len=192,
        block_size=4,
        num_kv_blocks=48,
        max_num_batched_tokens=40,
    ) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        core = llm.engine.core
        assert core.scheduler.num_preemptions > 0
        assert_no_block_leaks(core.block_manager)
    _check(hf_model, prompts, outputs, references)
