"""Engine behaviour on a tiny random model: stops, logprobs, seeds, bad input, chat."""

import json
import math
import shutil

import pytest
import torch
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    path = str(tmp_path_factory.mktemp("tiny_chat") / "m")
    hf = make_tiny_chat_model(path, smollm2_path, num_hidden_layers=2)
    return path, hf


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(
        tiny[0], dtype="float32", max_model_len=128, block_size=8, num_kv_blocks=128
    ) as engine:
        yield engine


def test_max_tokens_and_ignore_eos(llm):
    out = llm.generate(
        "hello there", SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"
    assert out.finished and out.prompt == "hello there"


def test_stop_token_ids_and_eos(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens = llm.generate("abc", greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    out = llm.generate(
        "abc", greedy.model_copy(update={"stop_token_ids": (stop_at,)}), use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop_at)


def test_eos_stops_unless_ignored(tiny, smollm2_path):
    # A model whose EOS is its favourite token: it stops at once unless ignore_eos.
    path, _ = tiny
    with LLM(path, dtype="float32", max_model_len=64, num_kv_blocks=64) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        first = llm.generate("x", greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
        llm.engine.tokenizer.eos_token_id = first
        out = llm.generate("x", greedy.model_copy(update={"ignore_eos": False}), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == [first] and out.outputs[0].finish_reason == "stop"


def test_generation_config_eos_ids_stop_generation(tiny, tmp_path):
    """Every `eos_token_id` of generation_config.json (a list, as Llama-3 ships it) ends a
    request like a stop token id, unless ignore_eos."""
    path = tmp_path / "m"
    shutil.copytree(tiny[0], path)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(str(path), dtype="float32", max_model_len=64, num_kv_blocks=64) as llm:
        tokens = llm.generate("x", greedy, use_tqdm=False)[0].outputs[0].token_ids
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, tokens[3]]}))
    with LLM(str(path), dtype="float32", max_model_len=64, num_kv_blocks=64) as llm:
        out = llm.generate("x", greedy.model_copy(update={"ignore_eos": False}), use_tqdm=False)
        completion = out[0].outputs[0]
        assert completion.token_ids == tokens[: tokens.index(tokens[3]) + 1]
        assert (completion.finish_reason, completion.stop_reason) == ("stop", tokens[3])
        assert llm.generate("x", greedy, use_tqdm=False)[0].outputs[0].token_ids == tokens


def test_stop_string_is_cut_from_text(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate("tell me", greedy, use_tqdm=False)[0].outputs[0]
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop and stop in text
    out = llm.generate("tell me", greedy.model_copy(update={"stop": (stop,)}), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < len(full.token_ids)


def test_logprobs_match_the_model(llm, tiny):
    _, hf = tiny
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    ids = [5, 6, 7, *out.token_ids]
    with torch.no_grad():
        logprobs = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    total = 0.0
    for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = logprobs[2 + j]
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert math.isclose(entry[token].logprob, row[token].item(), abs_tol=1e-4)
        top3 = row.topk(3).indices.tolist()
        assert set(entry) == set(top3)
        total += entry[token].logprob
    assert math.isclose(out.cumulative_logprob, total, abs_tol=1e-5)


def test_n_sequences_per_prompt(llm):
    """`n` = 3: three completions (index 0..2), sequence i seeded with seed + i; the other
    prompt of the call keeps its place."""
    seeded = SamplingParams(temperature=1.0, seed=77, max_tokens=8, ignore_eos=True, n=3)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(["once upon", "abc"], [seeded, greedy], use_tqdm=False)
    assert len(outs) == 2 and len(outs[1].outputs) == 1
    assert outs[0].prompt == "once upon" and outs[0].finished
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    for i, completion in enumerate(outs[0].outputs):
        alone = seeded.model_copy(update={"n": 1, "seed": 77 + i})
        assert (
            completion.token_ids
            == llm.generate("once upon", alone, use_tqdm=False)[0].outputs[0].token_ids
        )
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    assert (
        outs[1].outputs[0].token_ids
        == llm.generate("abc", greedy, use_tqdm=False)[0].outputs[0].token_ids
    )
    # the front end fans n out wherever a request enters: here the engine's own add_request
    llm.engine.add_request("x", "abc", greedy.model_copy(update={"n": 2}))
    finished = []
    while not finished:
        finished = [o for o in llm.engine.step() if o.finished]
    (out,) = finished
    assert out.request_id == "x" and [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [outs[1].outputs[0].token_ids] * 2


def test_seeded_sampling_is_independent_of_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate("once upon", seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)] * 3
    batch = llm.generate(
        ["a", "once upon", "b c", "d"], [others[0], seeded, *others[1:]], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone
    different_seed = seeded.model_copy(update={"seed": 99})
    assert (
        llm.generate("once upon", different_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    )


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "the prompt is empty"),
        ({"prompt_token_ids": []}, SamplingParams(), "the prompt is empty"),
        ({"prompt_token_ids": list(range(200))}, SamplingParams(), "more than max_model_len=128"),
        ({"prompt_token_ids": [1, 49152]}, SamplingParams(), "outside the vocabulary"),
        ({"prompt_token_ids": [1, -3]}, SamplingParams(), "outside the vocabulary"),
        ("hi", SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        ("hi", SamplingParams(max_tokens=200), "ask for at most 12[0-9] tokens"),
        ("hi", SamplingParams(logit_bias={"49152": 1}), "logit_bias"),
        ("\ud800", SamplingParams(), "lone surrogate"),
        ("hi", {"temperature": 0}, "must be a SamplingParams"),
    ],
)
def test_bad_input_is_refused_and_others_finish(llm, prompt, params, message):
    good = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine", prompt], [good, params], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing half-added is left behind
    assert len(llm.generate("fine", good, use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_invalid_sampling_params_name_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "Hello"}]
    out = llm.chat(
        messages, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )[0]
    assert out.prompt.endswith("<|im_start|>assistant\n")
    expected = llm.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out.prompt_token_ids == list(expected)


def test_unknown_engine_argument_is_refused(tiny):
    with pytest.raises(ValueError, match="unknown engine arguments: \\['block_sise'\\]"):
        LLM(tiny[0], block_sise=4)
