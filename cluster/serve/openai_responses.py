"""OpenAI response bodies and stream chunks (completions and chat) built from the
`GenerateOutput`s of one request's choices."""

from __future__ import annotations

import time
import uuid
from typing import Any

from cluster.serve.protocol import GenerateOutput, TokenLogprob


def _chat_logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _usage(outs: list[GenerateOutput], choices_per_prompt: int) -> dict[str, int]:
    """Every prompt's tokens (choice i * n + j answers prompt i), every choice's tokens."""
    prompt = sum(o.num_prompt_tokens for o in outs[::choices_per_prompt])
    completion = sum(o.num_output_tokens for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class ResponseFormatter:
    """Builds one request's response body or stream chunks (completion or chat), for
    each of its choices (`index`)."""

    def __init__(
        self, model: str, chat: bool, echo_only: bool = False, choices_per_prompt: int = 1
    ) -> None:
        self.model = model
        self.choices_per_prompt = choices_per_prompt
        self.chat = chat
        # Completions with `echo` and `max_tokens: 0`: the prompt alone, no completion.
        self.echo_only = echo_only
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._sent_role: set[int] = set()
        self._text_offset: dict[int, int] = {}  # completions' `text_offset` of the next token

    def _logprobs(self, tokens: list[TokenLogprob] | None, index: int) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens: chat's `content` list, or the legacy
        completions' parallel lists."""
        if tokens is None:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        **_chat_logprob(t.token, t.logprob),
                        "top_logprobs": [_chat_logprob(x.token, x.logprob) for x in t.top],
                    }
                    for t in tokens
                ]
            }
        offsets = []
        offset = self._text_offset.get(index, 0)
        for t in tokens:
            offsets.append(offset)
            offset += len(t.token)
        self._text_offset[index] = offset
        return {
            "tokens": [t.token for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [
                None if t.logprob is None else {x.token: x.logprob for x in t.top} for t in tokens
            ],
            "text_offset": offsets,
        }

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _choice(self, out: GenerateOutput, index: int, body: dict[str, Any]) -> dict[str, Any]:
        tokens = out.logprobs
        if not self.chat:  # `echo`: the prompt's tokens first (when the output has them)
            tokens = None if tokens is None else [] if self.echo_only else tokens
            if out.prompt_logprobs is not None:
                tokens = out.prompt_logprobs + (tokens or [])
        logprobs = self._logprobs(tokens, index)
        return {"index": index, **body, "finish_reason": out.finish_reason, "logprobs": logprobs}

    def _text(self, out: GenerateOutput) -> str:
        """A completion's text: the echoed prompt (in the first output), then the answer."""
        return (out.prompt or "") + ("" if self.echo_only else out.text)

    def full(self, outs: list[GenerateOutput]) -> dict[str, Any]:
        """The whole response: one choice per output, in order."""
        choices = []
        for index, out in enumerate(outs):
            if self.chat:
                body = {"message": {"role": "assistant", "content": out.text}}
            else:
                body = {"text": self._text(out)}
            choices.append(self._choice(out, index, body))
        envelope = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        return {**envelope, "usage": _usage(outs, self.choices_per_prompt)}

    def chunk(self, out: GenerateOutput, index: int = 0) -> dict[str, Any]:
        """A stream chunk carrying choice `index`'s new piece."""
        if self.chat:
            delta: dict[str, Any] = {"content": out.text}
            if index not in self._sent_role:
                delta["role"] = "assistant"
                self._sent_role.add(index)
            choice = self._choice(out, index, {"delta": delta})
            return self._envelope("chat.completion.chunk", [choice])
        return self._envelope(
            "text_completion", [self._choice(out, index, {"text": self._text(out)})]
        )

    def usage_chunk(self, lasts: list[GenerateOutput]) -> dict[str, Any]:
        """The final chunk with usage (`stream_options.include_usage`), from each choice's
        last output."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": _usage(lasts, self.choices_per_prompt)}
