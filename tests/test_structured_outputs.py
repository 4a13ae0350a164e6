"""Guided decoding (`structured_outputs`): the bitmask kernel against xgrammar's, the
engine's grammar state (forbidden drafts cut, one mask per draft position), and the real
default model's outputs: every one follows its grammar, and greedy outputs are the same
with speculation off, with n-gram chains and with an EAGLE-3 head's draft trees."""

import json
import re

import pytest
import torch
import xgrammar as xgr
from random_heads import write_eagle3
from transformers import AutoTokenizer

from cluster import LLM, SamplingParams
from cluster.config import ModelConfig
from cluster.engine.grammar import GrammarCompiler
from cluster.sample.grammar_mask import apply_token_bitmask, unpack_token_bitmask
from cluster.structured_outputs import StructuredOutputsParams

ENGINE = dict(dtype="bfloat16", max_model_len=320, max_num_seqs=4, num_kv_blocks=96)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "admin"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,6}"
CHOICES = ["red", "green", "blue"]
BOUNDED = ("json", "regex", "choice", "grammar")  # kinds whose every output ends within max_tokens
GRAMMAR = 'root ::= num " + " num " = " num\nnum ::= [0-9] | [1-9] [0-9]'
SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "json_object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}
QUESTIONS = [
    "Describe a person as JSON with a name, an age and a city.",
    "Which colour is the sky on a clear day?",
    "Write a short sum of small numbers.",
]


def _follows(kind: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)
        return (
            set(value) == set(SCHEMA["required"])
            and isinstance(value["name"], str)
            and len(value["name"]) <= 12
            and type(value["age"]) is int
            and 0 <= value["age"] <= 120
            and value["city"] in SCHEMA["properties"]["city"]["enum"]
            and type(value["admin"]) is bool
        )
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return (
        re.fullmatch(r"([0-9]|[1-9][0-9]) \+ ([0-9]|[1-9][0-9]) = ([0-9]|[1-9][0-9])", text)
        is not None
    )


def test_bitmask_matches_xgrammar_kernel():
    generator = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word's high bits lie past the vocabulary
    words = xgr.get_bitmask_shape(1, vocab)[1]
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=generator, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    logits = torch.randn(6, vocab, generator=generator)
    rows = torch.tensor([1, 2, 4])
    ours = logits.clone()
    apply_token_bitmask(ours, bitmask, rows)
    theirs, by_row = logits.clone(), xgr.allocate_token_bitmask(6, vocab)  # xgrammar: row i
    by_row[rows] = bitmask  # masks logits row i
    xgr.apply_token_bitmask_inplace(theirs, by_row, indices=rows.tolist())
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[0, 3, 5]], logits[[0, 3, 5]])  # unmasked rows untouched
    allowed = unpack_token_bitmask(bitmask, vocab)
    expected = [
        [bool(int(bitmask[r, t // 32]) >> (t % 32) & 1) for t in range(vocab)] for r in range(3)
    ]
    assert allowed.tolist() == expected
    assert 0 < int(allowed.sum()) < allowed.numel()


def test_request_grammar_cuts_forbidden_drafts_and_masks_every_draft_position(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    compiler = GrammarCompiler(ModelConfig(path=smollm2_path))
    grammar = compiler.request_grammar(SPECS["json"], [tokenizer.eos_token_id])
    good = tokenizer.encode('{"name": "Ann", "age": 41')
    forbidden = tokenizer.encode("}")[0]  # the object cannot close before "city"
    # A chain is cut at its first forbidden draft, nothing is consumed by looking.
    assert grammar.num_valid_drafts([*good, forbidden, *good], None) == len(good)
    assert grammar.num_valid_drafts([forbidden, *good], None) == 0
    # A tree keeps the nodes before the first whose path is forbidden.
    parents = [-1, 0, -1]  # "{", its child, then "}" as a second first token: forbidden
    assert grammar.num_valid_drafts([good[0], good[1], forbidden], parents) == 2

    words = xgr.get_bitmask_shape(1, compiler.vocab_size)[1]
    rows = torch.frombuffer(bytearray(grammar.bitmask(good, None)), dtype=torch.int32)
    rows = rows.view(1 + len(good), words)
    for i in range(len(good) + 1):  # row i: a fresh matcher that accepted good[:i]
        fresh = compiler.request_grammar(SPECS["json"], [tokenizer.eos_token_id])
        fresh.accept(good[:i])
        expected = xgr.allocate_token_bitmask(1, compiler.vocab_size)
        fresh.matcher.fill_next_token_bitmask(expected, 0)
        assert torch.equal(rows[i], expected[0]), i
    grammar.accept(good)  # the state moved only now
    assert grammar.num_valid_drafts([forbidden], None) == 0
    assert grammar.num_valid_drafts(tokenizer.encode(', "city": "Paris"'), None) > 0


@pytest.fixture(scope="module")
def prompts(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]


def _generate(llm, prompts, **params):
    outs = {}
    for kind, spec in SPECS.items():
        sampling = SamplingParams(max_tokens=64, structured_outputs=spec, **params)
        outs[kind] = [o.outputs[0] for o in llm.generate(prompts, sampling, use_tqdm=False)]
    return outs


@pytest.mark.slow
def test_guided_outputs_follow_their_grammar_with_and_without_speculation(
    smollm2_path, prompts, tmp_path
):
    head = write_eagle3(str(tmp_path / "eagle3"), smollm2_path, draft_vocab_size=4096, seed=3)
    greedy = {}
    for name, spec in [
        ("off", None),
        ("ngram", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
        (
            "eagle3",
            {"model": head, "num_speculative_tokens": 3, "tree": {"num_nodes": 6, "topk": 2}},
        ),
    ]:
        with LLM(smollm2_path, speculative_config=spec, **ENGINE) as llm:
            greedy[name] = _generate(llm, prompts, temperature=0)
            num_drafts = llm.get_metrics().get("num_draft_tokens", 0)
            # Sampling too, where the drafts come from a distribution (rejection sampling)
            sampled = _generate(llm, prompts, temperature=1.0, seed=7) if name == "eagle3" else {}
        assert spec is None or num_drafts > 0, name
        for outs in (greedy[name], sampled):
            for kind, outputs in outs.items():
                for out in outputs:
                    if kind in BOUNDED:  # (the others' text may run past max_tokens)
                        assert out.finish_reason == "stop", (name, kind, out.text)
                    if out.finish_reason == "stop":
                        assert _follows(kind, out.text), (name, kind, out.text)
        for kind, outputs in greedy[name].items():  # (no kind vacuous)
            assert any(o.finish_reason == "stop" for o in outputs), (name, kind)
    for name in ("ngram", "eagle3"):
        for kind in SPECS:
            assert [o.token_ids for o in greedy[name][kind]] == [
                o.token_ids for o in greedy["off"][kind]
            ], (name, kind)
