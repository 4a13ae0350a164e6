"""Tool calling on `/v1/chat/completions`, as vLLM does it.

The request's `tools` reach the model's chat template (a template that does not render
tools simply leaves them out of the prompt, as with vLLM). What the answer may be
depends on `tool_choice`:
- `"none"`: text only, nothing parsed;
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is
  that function's arguments, held to its `parameters` schema by guided decoding; the
  message carries one tool call (finish reason `stop`, as OpenAI's forced calls);
- `"required"`: the output is a JSON list of `{"name", "parameters"}` calls, held to the
  tools' schemas (one call at most with `parallel_tool_calls: false`); finish reason
  `tool_calls`;
- `"auto"` (the default with tools): the model decides; its calls are parsed out of the
  text by the server's tool-call parser (`server.tool_call_parser`; `hermes`:
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the Qwen and Hermes
  families' format). Without a parser, `"auto"` is a 400, as vLLM without
  `--enable-auto-tool-choice`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.structured_outputs import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class _FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: _FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolCalling:
    """How one request's answer is read: its mode and, named, the function."""

    mode: Literal["named", "required", "auto"]
    function: str | None = None  # named mode's

    @staticmethod
    def plan(
        tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None
    ) -> tuple[ToolCalling | None, StructuredOutputsParams | None]:
        """(how to read the answer, the grammar that shapes it); raises ValueError naming
        the field for a choice the tools cannot meet."""
        if not tools:
            if choice not in (None, "none"):
                raise ValueError("tool_choice: needs tools")
            return None, None
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if choice == "none":
            return None, None
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if name not in names:
                raise ValueError(f"tool_choice: no tool is named {name!r} (tools: {names})")
            schema = tools[names.index(name)].function.parameters
            return ToolCalling("named", name), StructuredOutputsParams(json=schema)
        if choice == "required":
            return ToolCalling("required"), StructuredOutputsParams(
                json=required_schema(tools, parallel is not False)
            )
        return ToolCalling("auto"), None

    def parse(self, text: str, parser: str | None) -> tuple[str | None, list[dict[str, Any]]]:
        """(the message's content, its tool calls in OpenAI's form) from the output text."""
        if self.mode == "named":
            return None, [tool_call(self.function or "", text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
            except ValueError:  # cut by max_tokens: no call to report
                return text, []
            return None, [tool_call(c["name"], json.dumps(c["parameters"])) for c in calls]
        if parser == "hermes":
            return parse_hermes(text)
        return text, []


def required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """A JSON list of calls, each one of the tools with its parameters' schema."""
    one_of = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """One tool call as OpenAI returns it (`arguments` is JSON text)."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks become calls; the
    text before the first block is the content. A block that is not such JSON leaves the
    whole text as content (no calls), as vLLM's parser does."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for block in _HERMES_CALL.findall(text[start:]):
        try:
            call = json.loads(block)
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return text, []
        if not isinstance(name, str):
            return text, []
        calls.append(tool_call(name, json.dumps(arguments, ensure_ascii=False)))
    content = text[:start].strip()
    return content or None, calls
