"""No OpenAI request field is ignored in silence: every field the `openai` client can send
(read from the client's own request types, so a new field fails here until it is placed)
is honoured, accepted as having no effect, or refused with an error naming it."""

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from pydantic import ValidationError

from cluster.serve.openai_protocol import (
    NO_EFFECT_FIELDS,
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
# Values that ask for something this server cannot do, one per unsupported field.
ASKING = {
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {"search_context_size": "low"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "store": True,
    "suffix": "end",
    "moderation": {"model": "x"},
}


@pytest.mark.parametrize(
    "request_cls, client_fields",
    [
        (ChatCompletionRequest, chat_create_params.CompletionCreateParamsBase.__annotations__),
        (CompletionRequest, completion_create_params.CompletionCreateParamsBase.__annotations__),
    ],
)
def test_every_client_field_is_honoured_passed_over_or_refused(request_cls, client_fields):
    honoured = set(request_cls.model_fields)
    placed = honoured | NO_EFFECT_FIELDS | UNSUPPORTED_FIELDS.keys()
    assert set(client_fields) - placed == set()
    assert set(ASKING) == set(UNSUPPORTED_FIELDS)  # every refusal is exercised below


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_FIELDS))
def test_unsupported_fields_are_refused_by_name_unless_neutral(field):
    base = COMPLETION if field == "suffix" else CHAT
    cls = CompletionRequest if field == "suffix" else ChatCompletionRequest
    with pytest.raises(ValidationError, match=field):
        cls(**base, **{field: ASKING[field]})
    neutral = {"modalities": ["text"]}.get(field)
    cls(**base, **{field: neutral})  # None / the neutral value asks for nothing


def test_no_effect_fields_pass_and_unknown_fields_are_refused():
    request = ChatCompletionRequest(**CHAT, user="u", metadata={"k": "v"}, service_tier="auto")
    assert request.sampling_params().max_tokens is None
    for cls, base in ((ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)):
        with pytest.raises(ValidationError, match="not_a_field"):
            cls(**base, not_a_field=1)
    with pytest.raises(ValidationError, match=r"stream_options\.include_usag"):  # a typo
        ChatCompletionRequest(**CHAT, stream_options={"include_usag": True})


def test_messages_take_text_parts_developer_and_name():
    message = {
        "role": "developer",
        "name": "ops",
        "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
    }
    request = ChatCompletionRequest(model="m", messages=[message])
    turn = request.messages[0].template_dict()
    assert turn == {"role": "system", "content": "Be brief.\nBe kind.", "name": "ops"}
    for bad, where in [
        ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "image_url"),
        ({"role": "user", "content": "x", "tool_calls": []}, "tool_calls"),
        ({"role": "narrator", "content": "x"}, "role"),
    ]:
        with pytest.raises(ValidationError, match=where):
            ChatCompletionRequest(model="m", messages=[bad])


def test_top_k_zero_and_minus_one_turn_it_off():
    for off in (0, -1):
        assert CompletionRequest(**COMPLETION, top_k=off).sampling_params().top_k == -1
    assert CompletionRequest(**COMPLETION, top_k=5).sampling_params().top_k == 5


def test_response_format_and_vllm_guided_fields_become_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formats = {
        "text": ({"type": "text"}, None),
        "json_object": ({"type": "json_object"}, "json_object"),
        "json_schema": (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            "json",
        ),
    }
    for cls, base in ((ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)):
        for response_format, kind in formats.values():
            spec = cls(**base, response_format=response_format).sampling_params().structured_outputs
            assert (spec and spec.kind) == kind
    for field, value, kind in [
        ("guided_json", schema, "json"),
        ("guided_regex", "[a-z]+", "regex"),
        ("guided_choice", ["yes", "no"], "choice"),
        ("guided_grammar", 'root ::= "a" | "b"', "grammar"),
        ("structured_outputs", {"choice": ["x"]}, "choice"),
    ]:
        params = ChatCompletionRequest(**CHAT, **{field: value}).sampling_params()
        assert params.structured_outputs.kind == kind
    # Two ways at once, a schema xgrammar cannot follow, a json_schema without its schema
    for bad, where in [
        ({"response_format": formats["json_object"][0], "guided_regex": "a"}, "guided_regex"),
        ({"guided_json": {"type": "nonsense"}}, "structured_outputs.json"),
        ({"guided_regex": "(["}, "structured_outputs.regex"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ]:
        with pytest.raises(ValueError, match=where):
            ChatCompletionRequest(**CHAT, **bad).sampling_params()
