"""Tool calling's request side and answer reading (`cluster.serve.tools`): how each
tool_choice shapes the output, the Hermes parser, tool turns in the conversation, the
tools reaching a chat template that renders them, and the response bodies and stream
chunks built from an answer."""

import json

import pytest
from transformers import AutoTokenizer

from cluster.config import ModelConfig
from cluster.engine.frontend import FrontEnd
from cluster.serve.openai_protocol import ChatCompletionRequest
from cluster.serve.openai_responses import ResponseFormatter
from cluster.serve.protocol import GenerateOutput
from cluster.serve.tools import ToolCalling, parse_hermes

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}]}


def _request(**fields):
    return ChatCompletionRequest(**CHAT, **fields)


def test_each_tool_choice_shapes_the_output():
    tools = [WEATHER, TIME]
    assert _request().tool_calling() is None
    assert _request(tools=tools, tool_choice="none").tool_calling() is None
    assert _request(tools=tools, tool_choice="none").sampling_params().structured_outputs is None
    auto = _request(tools=tools)  # "auto" by default with tools: read, not shaped
    assert auto.tool_calling().mode == "auto"
    assert auto.sampling_params().structured_outputs is None
    named = _request(
        tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    assert named.tool_calling() == ToolCalling("named", "get_weather")
    schema = json.loads(named.sampling_params().structured_outputs.json_schema)
    assert schema == WEATHER["function"]["parameters"]
    for parallel, most in ((None, None), (False, 1)):
        required = _request(tools=tools, tool_choice="required", parallel_tool_calls=parallel)
        schema = json.loads(required.sampling_params().structured_outputs.json_schema)
        assert schema["type"] == "array" and schema["minItems"] == 1
        assert schema.get("maxItems") == most
        names = [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]]
        assert names == [["get_weather"], ["get_time"]]
    # The tools reach the template (in OpenAI's form), whatever the choice.
    assert auto.prompts()[0]["tools"][0]["function"]["name"] == "get_weather"


def test_tool_choices_the_tools_cannot_meet_are_refused_by_name():
    for fields, where in [
        ({"tool_choice": "required"}, "tool_choice: needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "no tool is named",
        ),
        ({"tools": [WEATHER, WEATHER]}, "unique"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"},
            "tool_choice and guided_regex",
        ),
    ]:
        with pytest.raises(ValueError, match=where):
            _request(**fields).sampling_params()
    with pytest.raises(ValueError, match="tool_choice"):
        _request(tools=[WEATHER], tool_choice="sometimes")
    with pytest.raises(ValueError, match="name"):
        _request(tools=[{"type": "function", "function": {"name": "has space"}}])


def test_hermes_parser_reads_calls_and_keeps_the_text_before_them():
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = parse_hermes(text)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["type"] == "function"
    assert parse_hermes("No tools needed.") == ("No tools needed.", [])
    # A block cut short or not a call: no calls, the text stays as content.
    for broken in ('<tool_call>{"name": "get_wea', "<tool_call>[1, 2]</tool_call>"):
        assert parse_hermes(broken) == (broken, [])
    content, calls = parse_hermes('<tool_call>{"name": "get_time", "arguments": {}}')
    assert content is None and len(calls) == 1  # stopped at EOS before the closing tag


def test_tool_turns_in_the_conversation():
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    request = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=[WEATHER],
        tool_choice="none",
    )
    turns = [m.template_dict() for m in request.messages]
    assert turns[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    assert turns[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    for bad, where in [
        ({"role": "user", "content": "x", "tool_calls": [call]}, "tool_calls"),
        ({"role": "user", "content": "x", "tool_call_id": "call_1"}, "tool_call_id"),
        ({"role": "assistant", "content": None}, "content"),
    ]:
        with pytest.raises(ValueError, match=where):
            ChatCompletionRequest(model="m", messages=[bad])


def test_tools_and_template_kwargs_reach_a_template_that_renders_them(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.chat_template = (  # a Hermes-style template: tools listed in the system turn
        "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t['function']['name'] }};"
        "{% endfor %}</tools><|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        "{% if enable_thinking %}<think>{% endif %}"
    )
    frontend = FrontEnd(tokenizer, ModelConfig(path=smollm2_path))
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = frontend.chat_prompt(messages, tools=[WEATHER, TIME])
    assert "<tools>get_weather;get_time;</tools>" in with_tools["prompt"]
    assert with_tools["prompt_token_ids"] == tokenizer.encode(with_tools["prompt"])
    assert "<tools>" not in frontend.chat_prompt(messages)["prompt"]
    thinking = frontend.chat_prompt(messages, chat_template_kwargs={"enable_thinking": True})
    assert thinking["prompt"].endswith("assistant\n<think>")
    assert "<think>" not in frontend.chat_prompt(messages)["prompt"]
    with pytest.raises(ValueError, match=r"chat_template_kwargs.*tools"):
        frontend.chat_prompt(messages, chat_template_kwargs={"tools": []})


def _output(text, finish="stop", **fields):
    return GenerateOutput(
        request_id="r", text=text, token_ids=[1] * len(text), finish_reason=finish, **fields
    )


def test_answers_become_tool_calls_in_bodies_and_streams():
    named = ResponseFormatter("m", chat=True, tools=ToolCalling("named", "get_weather"))
    body = named.full([_output('{"city": "Paris"}')])["choices"][0]
    assert body["finish_reason"] == "stop"  # a forced call stops, as OpenAI's
    assert body["message"]["content"] is None
    (call,) = body["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

    required = ResponseFormatter("m", chat=True, tools=ToolCalling("required"))
    answer = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'
    body = required.full([_output(answer)])["choices"][0]
    assert body["finish_reason"] == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in body["message"]["tool_calls"]] == [
        {},
        {"city": "Rome"},
    ]
    cut = required.full([_output('[{"name": "get_ti', "length")])["choices"][0]
    assert cut["finish_reason"] == "length" and "tool_calls" not in cut["message"]

    auto = ResponseFormatter("m", chat=True, tools=ToolCalling("auto"), tool_call_parser="hermes")
    plain = auto.full([_output("It is sunny.")])["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "It is sunny."}
    assert plain["finish_reason"] == "stop"

    # Streamed: nothing until the answer is whole, then one delta with the calls.
    stream = ResponseFormatter("m", chat=True, tools=ToolCalling("auto"), tool_call_parser="hermes")
    pieces = [
        '<tool_call>{"name": "get_weather", ',
        '"arguments": {"city": "Oslo"}}',
        "</tool_call>",
    ]
    chunks = [stream.chunk(_output(p, None if i < 2 else "stop")) for i, p in enumerate(pieces)]
    assert chunks[:2] == [None, None]
    (choice,) = chunks[2]["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["delta"]["role"] == "assistant"
    (call,) = choice["delta"]["tool_calls"]
    assert call["index"] == 0 and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
