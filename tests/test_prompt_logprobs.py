"""`prompt_logprobs`: the target's log-softmax at every prompt position, equal to
transformers' on the same weights, across prompt chunks, with speculation, with the
prefix cache on (such a request computes every position) and through preemption."""

import math

import pytest
import torch
from block_checks import assert_no_block_leaks
from pydantic import ValidationError
from random_heads import write_all
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams

# Chunks of 16 tokens: the 45-token prompt spans three, one of which also decodes.
ENGINE = dict(
    dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16
)
PROMPTS = [list(range(300, 345)), [7, 8, 9, 10, 11], [42]]
TOP = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("prompt_logprobs")
    hf = make_tiny_chat_model(str(root / "target"), smollm2_path, num_hidden_layers=4, seed=3)
    path = str(root / "target")
    return path, hf, write_all(str(root / "drafts"), path)


def _generate(path, prompts=PROMPTS, params=None, spec=None, **engine):
    params = params or SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=TOP, logprobs=1
    )
    spec = {**spec, "num_speculative_tokens": 3} if spec else None
    with LLM(path, speculative_config=spec, **{**ENGINE, **engine}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_no_block_leaks(llm.engine.core.block_manager)
        return outs, llm.engine.core.scheduler.num_preemptions


def _check_against_transformers(outs, hf):
    for out in outs:
        ids = out.prompt_token_ids
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        with torch.no_grad():
            reference = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        for position, (token, entry) in enumerate(
            zip(ids[1:], out.prompt_logprobs[1:], strict=True)
        ):
            row = reference[position]
            assert math.isclose(entry[token].logprob, row[token].item(), abs_tol=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(TOP).indices.tolist()
            assert set(top) <= set(entry) and len(entry) <= TOP + 1
            for rank, t in enumerate(top, start=1):
                assert math.isclose(entry[t].logprob, row[t].item(), abs_tol=1e-4)
                if t != token:
                    assert entry[t].rank == rank


def test_prompt_logprobs_equal_transformers_across_chunks(target):
    path, hf, _ = target
    outs, _ = _generate(path)
    _check_against_transformers(outs, hf)
    # a request that did not ask has none
    plain, _ = _generate(path, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2))
    assert plain[0].prompt_logprobs is None


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_speculation_changes_no_logprob(target, method):
    path, _, specs = target
    base, _ = _generate(path)
    spec, _ = _generate(path, spec=specs[method])
    for a, b in zip(base, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_logprobs == b.prompt_logprobs
        got = [
            e[t].logprob for t, e in zip(b.outputs[0].token_ids, b.outputs[0].logprobs, strict=True)
        ]
        want = [
            e[t].logprob for t, e in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, strict=True)
        ]
        assert got == pytest.approx(want, abs=1e-5)
    assert sum(o.outputs[0].num_draft_tokens for o in spec) > 0


def test_a_cached_prompt_is_computed_again_for_its_logprobs(target):
    path, hf, _ = target
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(path, **ENGINE) as llm:
        prompt = {"prompt_token_ids": PROMPTS[0]}
        first = llm.generate(prompt, greedy, use_tqdm=False)[0]
        asked = greedy.model_copy(update={"prompt_logprobs": TOP})
        again = llm.generate([prompt, prompt], [asked, greedy], use_tqdm=False)
        stats = llm.engine.core.block_manager.prefix_stats
        # the plain repeat hit every whole block but the last token's (44 tokens); the
        # request asking for logprobs did not take any
        assert stats.num_hit_tokens == 44
    _check_against_transformers(again[:1], hf)
    assert first.outputs[0].token_ids == again[0].outputs[0].token_ids
    assert again[1].outputs[0].token_ids == first.outputs[0].token_ids


def test_preempted_prompts_give_each_position_once(target):
    """So few blocks that requests are preempted mid-prompt and compute it again."""
    path, hf, _ = target
    prompts = [PROMPTS[0], list(range(500, 540)), list(range(600, 630))]
    outs, num_preemptions = _generate(
        path, prompts, max_model_len=64, num_kv_blocks=20, max_num_batched_tokens=64
    )
    assert num_preemptions > 0
    _check_against_transformers(outs, hf)


def test_prompt_logprobs_is_validated(target):
    with pytest.raises(ValidationError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    path, _, _ = target
    with (
        LLM(path, **ENGINE) as llm,
        pytest.raises(ValueError, match=r"prompt_logprobs=\d+ exceeds the vocabulary"),
    ):
        llm.generate("hi", SamplingParams(prompt_logprobs=10**7), use_tqdm=False)
