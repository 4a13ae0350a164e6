"""`StructuredOutputsParams`: the shape a request's output must take (guided decoding).

vLLM's names: exactly one of `json` (a JSON schema), `json_object` (any JSON object),
`regex`, `choice` (one of these strings) or `grammar` (EBNF, as xgrammar reads it). The
spec is checked at construction, so a schema xgrammar cannot follow is a `ValueError`
naming the field before any engine sees the request. The engine compiles it against the
tokenizer (`cluster.engine.grammar`); the sampler masks every token the grammar forbids
at each position, drafts included, so a forbidden draft is never accepted.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# (attribute, the name users write): `json` is pydantic's own method name, so the schema
# lives in `json_schema` and is given as `json`.
_KINDS = {
    "json_schema": "json",
    "json_object": "json_object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}

# "[21:30:28] /project/cpp/x.cc:94: " and "Check failed: (...) is false: " before its messages
_XGRAMMAR_PREFIX = re.compile(r"^(\[[^\]]*\] \S+:\d+: )?(Check failed: .*? is false: )?")


class StructuredOutputsParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    # A JSON schema, as JSON text (a dict is accepted and dumped); written `json=`.
    json_schema: str | None = Field(default=None, alias="json")
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # JSON only: no whitespace beyond what JSON needs (xgrammar's any_whitespace off).
    disable_any_whitespace: bool = False

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema_text(cls, v: Any) -> Any:
        if isinstance(v, dict | bool):
            return json.dumps(v)
        return v

    @field_validator("choice", mode="before")
    @classmethod
    def _check_choice(cls, v: Any) -> Any:
        if v is None:
            return v
        if isinstance(v, str) or not all(isinstance(c, str) and c for c in v) or not v:
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return tuple(v)

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputsParams:
        given = [name for k, name in _KINDS.items() if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs takes exactly one of {', '.join(_KINDS.values())}; got "
                f"{', '.join(given) or 'none'}"
            )
        self.to_grammar()  # raises ValueError naming the field if xgrammar cannot follow it
        return self

    @property
    def kind(self) -> str:
        """The one field given, by the name users write (`json`, `regex`, ...)."""
        return next(name for k, name in _KINDS.items() if getattr(self, k) not in (None, False))

    @property
    def any_whitespace(self) -> bool:
        return not self.disable_any_whitespace

    def to_grammar(self) -> Any:
        """The xgrammar `Grammar` (tokenizer-free) this spec asks for."""
        import xgrammar as xgr

        kind = self.kind
        try:
            if kind == "json":
                return xgr.Grammar.from_json_schema(
                    self.json_schema, any_whitespace=self.any_whitespace
                )
            if kind == "json_object":
                schema = json.dumps({"type": "object"})
                return xgr.Grammar.from_json_schema(schema, any_whitespace=self.any_whitespace)
            if kind == "regex":
                return xgr.Grammar.from_regex(self.regex)
            if kind == "choice":
                return xgr.Grammar.from_ebnf(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
                )
            return xgr.Grammar.from_ebnf(self.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            message = _XGRAMMAR_PREFIX.sub("", str(e).strip()) or type(e).__name__
            raise ValueError(f"structured_outputs.{kind}: {message}") from None
