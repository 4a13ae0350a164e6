"""Guided decoding in the engine core: each guided request's grammar state (xgrammar).

`GrammarCompiler` turns a request's `StructuredOutputsParams` into a compiled grammar
for the target's tokenizer (built on the first guided request, compiled grammars
cached); `RequestGrammar` follows one request's output. Every step it gives the
scheduler a token bitmask per sampled position: the position after the last token and
one after each draft (the state once that draft's path is accepted), so the sampler
masks forbidden tokens at draft positions exactly as it would without drafts, and greedy
output is the same with speculation on or off. Drafts are cut at the first one the
grammar forbids when they arrive (it could only be rejected). The core is the one owner
of this state: tokens are accepted only once the step's output is back.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from cluster.config import ModelConfig
from cluster.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256


class GrammarCompiler:
    """Compiles grammars against the target's tokenizer (loaded on first use)."""

    def __init__(self, model: ModelConfig) -> None:
        self.tokenizer_path = model.tokenizer_path
        self.vocab_size = int(model.hf_config.vocab_size)  # the logits' width
        self._compiler: Any = None
        self._cache: OrderedDict[StructuredOutputsParams, Any] = OrderedDict()

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        import xgrammar as xgr

        if self._compiler is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        compiled = self._cache.pop(spec, None)
        if compiled is None:
            compiled = self._compiler.compile_grammar(spec.to_grammar())
        self._cache[spec] = compiled
        if len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return compiled

    def request_grammar(
        self, spec: StructuredOutputsParams, stop_token_ids: list[int]
    ) -> RequestGrammar:
        """A fresh grammar state; `stop_token_ids` end the output once the grammar is done."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(
            self._compile(spec), override_stop_tokens=stop_token_ids or None
        )
        return RequestGrammar(matcher, self.vocab_size)


class RequestGrammar:
    """One request's position in its grammar, advanced by the tokens it outputs."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def accept(self, tokens: list[int]) -> None:
        for token in tokens:
            if self.matcher.is_terminated():
                return  # past its end (ignore_eos): nothing more to follow
            if not self.matcher.accept_token(token):
                logger.warning("token %d is outside the request's grammar", token)
                return

    def _walk(self, path: list[int]) -> bool:
        """Accept `path`'s tokens; False (and nothing accepted) if one is forbidden."""
        for n, token in enumerate(path):
            if not self.matcher.accept_token(token):
                if n:
                    self.matcher.rollback(n)
                return False
        return True

    def num_valid_drafts(self, drafts: list[int], parents: list[int] | None) -> int:
        """How many leading drafts the grammar allows along their paths (a tree's nodes
        come parents first, so the count keeps whole paths)."""
        for i in range(len(drafts)):
            path = _path(drafts, parents, i)
            if not self._walk(path):
                return i
            self.matcher.rollback(len(path))
        return len(drafts)

    def bitmask(self, drafts: list[int], parents: list[int] | None) -> bytes:
        """int32 [1 + len(drafts), ceil(vocab / 32)] allowed-token bits, little-endian: the
        row after the last token, then the row after each draft's path."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(1 + len(drafts), self.vocab_size)  # all allowed
        self.matcher.fill_next_token_bitmask(mask, 0)
        for i in range(len(drafts)):
            path = _path(drafts, parents, i)
            if self._walk(path):  # (a forbidden path's rows are never sampled from)
                if not self.matcher.is_terminated():  # (past a stop token: the end)
                    self.matcher.fill_next_token_bitmask(mask, 1 + i)
                self.matcher.rollback(len(path))
        return mask.numpy().tobytes()


def _path(drafts: list[int], parents: list[int] | None, node: int) -> list[int]:
    """Tokens from the last real token's child down to draft `node` (chain: drafts[:node+1])."""
    if parents is None:
        return drafts[: node + 1]
    path = []
    while node >= 0:
        path.append(drafts[node])
        node = parents[node]
    return path[::-1]
