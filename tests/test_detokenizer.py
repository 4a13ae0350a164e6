"""Streaming detokenization is correct when tokens split multi-byte UTF-8 characters."""

import pytest
from transformers import AutoTokenizer

from cluster.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Héllo wörld — ünïcödé ✓",
    "emoji 🤖🚀 and CJK 中文字符 mixed",
    " leading space and\nnew lines\n\n",
]


@pytest.fixture(scope="module", params=["fast", "slow"])
def tokenizer(smollm2_path, request):
    """The fast one decodes with `tokenizers`' DecodeStream, the slow one by windows."""
    fast = AutoTokenizer.from_pretrained(smollm2_path)
    if request.param == "fast":
        return fast

    class Slow:  # the same vocabulary without the Rust tokenizer: the window path
        def encode(self, text):
            return fast.encode(text)

        def decode(self, ids, skip_special_tokens=False):
            return fast.decode(ids, skip_special_tokens=skip_special_tokens)

    return Slow()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_equals_full_decode(tokenizer, text, chunk):
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    assert "".join(deltas) == tokenizer.decode(ids) == detok.text
    assert all("\ufffd" not in d for d in deltas)


def test_split_character_is_held_back(tokenizer):
    ids = tokenizer.encode("🤖")
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    assert detok.add_tokens(ids[:1]) == ""
    assert "".join(detok.add_tokens([t]) for t in ids[1:]) == "🤖"
