"""OpenAI response bodies and stream chunks (completions and chat) built from the
`GenerateOutput`s of one request's choices.

With tool calling (`cluster.serve.tools`), a chat answer's text is read into content and
`tool_calls`; a streamed one then goes out whole in its final chunk (a call can only be
parsed once its text is complete).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from cluster.serve.protocol import GenerateOutput, TokenLogprob, joined
from cluster.serve.tools import ToolCalling


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
        self,
        model: str,
        chat: bool,
        echo_only: bool = False,
        choices_per_prompt: int = 1,
        tools: ToolCalling | None = None,
        tool_call_parser: str | None = None,
    ) -> None:
        self.model = model
        self.tools = tools
        self.tool_call_parser = tool_call_parser
        self._held: dict[int, list[GenerateOutput]] = {}  # streamed tool answers, so far
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
            if self.tools is not None:
                message, finish = self._tool_message(out)
                choice = self._choice(out, index, {"message": message})
                choices.append({**choice, "finish_reason": finish})
                continue
            if self.chat:
                body = {"message": {"role": "assistant", "content": out.text}}
            else:
                body = {"text": self._text(out)}
            choices.append(self._choice(out, index, body))
        envelope = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        return {**envelope, "usage": _usage(outs, self.choices_per_prompt)}

    def _tool_message(self, out: GenerateOutput) -> tuple[dict[str, Any], str | None]:
        """(the assistant message with its tool calls, the finish reason): `tool_calls`
        when the model called tools by choice (a forced named call stops, as OpenAI's)."""
        assert self.tools is not None
        content, calls = self.tools.parse(out.text, self.tool_call_parser)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish = out.finish_reason
        if calls:
            message["tool_calls"] = calls
            if self.tools.mode != "named" and finish == "stop":
                finish = "tool_calls"
        return message, finish

    def chunk(self, out: GenerateOutput, index: int = 0) -> dict[str, Any] | None:
        """A stream chunk carrying choice `index`'s new piece (None: nothing to send yet)."""
        if self.tools is not None:
            return self._tool_chunk(out, index)
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

    def _tool_chunk(self, out: GenerateOutput, index: int) -> dict[str, Any] | None:
        """Held until the answer is complete, then one delta with all of it."""
        held = self._held.setdefault(index, [])
        held.append(out)
        if out.finish_reason is None:
            return None
        del self._held[index]
        whole = joined(held)
        message, finish = self._tool_message(whole)
        if "tool_calls" in message:
            message["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        choice = self._choice(whole, index, {"delta": message})
        return self._envelope("chat.completion.chunk", [{**choice, "finish_reason": finish}])

    def usage_chunk(self, lasts: list[GenerateOutput]) -> dict[str, Any]:
        """The final chunk with usage (`stream_options.include_usage`), from each choice's
        last output."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": _usage(lasts, self.choices_per_prompt)}
