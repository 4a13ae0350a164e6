"""Incremental detokenization that never splits a multi-byte UTF-8 character.

Decoding one token at a time is wrong for byte-level tokenizers: a character such as
"é" or an emoji can span several tokens, and each token alone decodes to U+FFFD. Fast
(Rust) tokenizers decode with the `tokenizers` library's own `DecodeStream`, primed with
the prompt's last tokens so the first answer token's spacing is right, which holds text
back until it is valid UTF-8 and handles byte-fallback tokens. Slow tokenizers decode a
small window of the most recent tokens twice (with and without the new ones) and emit only
the extension, holding text back while it ends in an incomplete character.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

_REPLACEMENT = "\ufffd"
_PREFIX_WINDOW = 6  # tokens of context before the first new one


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._rust = getattr(tokenizer, "_tokenizer", None)  # a fast tokenizer's own
        if self._rust is not None:
            context = list(prompt_token_ids[-_PREFIX_WINDOW:])
            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
            return
        self.token_ids: list[int] = list(prompt_token_ids[-_PREFIX_WINDOW:])
        self.prefix_offset = 0  # start of the context window in token_ids
        self.read_offset = len(self.token_ids)  # tokens before this are already in `text`

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly complete text (possibly empty)."""
        if self._rust is not None:
            pieces = (self._stream.step(self._rust, t) for t in new_token_ids)
            delta = "".join(p for p in pieces if p is not None)
        else:
            delta = self._window_delta(new_token_ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _window_delta(self, new_token_ids: list[int]) -> str:
        self.token_ids.extend(new_token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or an incomplete character at the end
        self.prefix_offset = max(self.read_offset, len(self.token_ids) - _PREFIX_WINDOW)
        self.read_offset = len(self.token_ids)
        return full[len(prefix) :]
