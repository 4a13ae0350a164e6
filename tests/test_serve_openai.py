"""The default manifest deployed on Serve, used through the real `openai` client over HTTP
and through a Serve handle: greedy answers equal `LLM.from_manifest` on the same file;
errors are OpenAI-style with real statuses; a client that leaves frees its request."""

import asyncio
import io
import json
import os
import urllib.error
import urllib.request

import openai
import pytest
import ray
from ray import serve
from ray_helpers import init_local_ray, speculation_supported, wait_for
from transformers import AutoTokenizer

from cluster import LLM, SamplingParams
from cluster.cli import main
from cluster.serve import GenerateRequest, load_manifest
from cluster.serve.launch import deploy
from cluster.serve.openai_protocol import CompletionRequest
from cluster.structured_outputs import StructuredOutputsParams

DEFAULT = os.path.join(os.path.dirname(__file__), "..", "cluster", "manifests", "default.yaml")
API_KEY = "sk-test"
MAX_TOKENS = 16
PROMPT = "The three primary colours are"
QUESTION = "What is the capital of France?"
# The same overrides, as manifest sections (deployed) and as engine arguments (offline).
SECTIONS = {
    "model": {"max_model_len": 512},
    "cache": {"num_kv_blocks": 96},
    "scheduler": {"max_num_seqs": 2},
}
FLAT = {"max_model_len": 512, "num_kv_blocks": 96, "max_num_seqs": 2}
JSON_QUESTION = "Describe a city as JSON."
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "rainy": {"type": "boolean"}},
    "required": ["city", "rainy"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served(smollm2_path):
    speculating = speculation_supported(smollm2_path)
    # The default manifest's drafts, every step (an adaptive engine may measure that no
    # drafts pay on a loaded machine, and the metrics test counts drafts).
    spec = {"speculative": {"adaptive": False}} if speculating else {"speculative": None}
    manifest = (
        load_manifest(DEFAULT)
        .with_args(
            **SECTIONS,
            **spec,
            server={
                "api_key": API_KEY,
                "max_waiting_requests": 1,
                "enable_auto_tool_choice": True,
                "tool_call_parser": "hermes",
            },
        )
        .with_deployment("LLMServer", graceful_shutdown_timeout_s=1)
    )
    offline = {**FLAT, **({} if speculating else {"speculative_config": None})}
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with LLM.from_manifest(DEFAULT, **offline) as llm:
        reference = {
            "completion": llm.generate(PROMPT, greedy, use_tqdm=False)[0],
            "chat": llm.chat([{"role": "user", "content": QUESTION}], greedy, use_tqdm=False)[0],
        }
    # Logprobs without speculation: the served engine (speculating) must give the same.
    with_logprobs = greedy.model_copy(update={"logprobs": 2})
    with LLM.from_manifest(DEFAULT, **{**FLAT, "speculative_config": None}) as plain:
        reference["logprobs"] = plain.generate(PROMPT, with_logprobs, use_tqdm=False)[0]
        reference["chat_logprobs"] = plain.chat(
            [{"role": "user", "content": QUESTION}], with_logprobs, use_tqdm=False
        )[0]
        with_prompt = with_logprobs.model_copy(update={"prompt_logprobs": 2})
        reference["echo"] = plain.generate(PROMPT, with_prompt, use_tqdm=False)[0]
        shaped = SamplingParams(
            temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=SCHEMA)
        )
        ask = [{"role": "user", "content": JSON_QUESTION}]
        reference["json"] = plain.chat(ask, shaped, use_tqdm=False)[0]
    init_local_ray(num_cpus=2)
    _, url = deploy(manifest)
    reference["speculating"] = speculating
    yield url, serve.get_deployment_handle("LLMServer", manifest.app_name), reference
    serve.shutdown()
    ray.shutdown()


def _client(url, key=API_KEY):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def test_completions_equal_offline_engine(served):
    url, _, reference = served
    expected = reference["completion"]
    client = _client(url)
    out = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert out.choices[0].text == expected.outputs[0].text
    assert out.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == len(expected.outputs[0].token_ids)
    chunks = list(
        client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
    )
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == expected.outputs[0].finish_reason


def test_chat_completions_equal_offline_engine(served):
    url, _, reference = served
    expected = reference["chat"].outputs[0]
    client = _client(url)
    messages = [{"role": "user", "content": QUESTION}]
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.usage.completion_tokens == len(expected.token_ids)
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_n_choices_streamed_or_not(served):
    """n choices are n requests: greedy ones agree, streamed or not, each chunk naming its
    choice; seeded sampled ones differ; usage counts the prompt once."""
    url, _, reference = served
    expected = reference["completion"].outputs[0]
    client = _client(url)
    model = "SmolLM2-135M-Instruct"
    greedy = dict(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    out = client.completions.create(**greedy, n=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [expected.text] * 2
    assert out.usage.completion_tokens == 2 * len(expected.token_ids)
    assert out.usage.prompt_tokens == len(reference["completion"].prompt_token_ids)
    chunks = list(
        client.completions.create(
            **greedy, n=3, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [expected.text] * 3
    assert chunks[-1].usage.completion_tokens == 3 * len(expected.token_ids)

    messages = [{"role": "user", "content": QUESTION}]
    sampled = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=1.0, seed=11, n=3
    )
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    assert len({c.message.content for c in sampled.choices}) > 1  # seeds 11, 12, 13


def test_choice_i_samples_with_seed_plus_i():
    request = CompletionRequest(model="m", prompt="p", n=3, seed=5, temperature=1)
    assert [p.seed for p in request.sampling_params().choices()] == [5, 6, 7]
    request = CompletionRequest(model="m", prompt="p", n=2)
    assert [p.seed for p in request.sampling_params().choices()] == [None, None]


def test_handle_generates_and_streams_the_same(served):
    _, llm, reference = served
    expected = reference["completion"].outputs[0]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    whole = llm.generate.remote(GenerateRequest(prompt=PROMPT, sampling_params=params)).result()
    assert (whole.text, whole.token_ids) == (expected.text, expected.token_ids)
    streamed = list(
        llm.options(stream=True).generate.remote(
            GenerateRequest(prompt=PROMPT, sampling_params=params, stream=True)
        )
    )
    assert len(streamed) > 2 and streamed[-1].finished
    assert not any(c.finished for c in streamed[:-1])
    assert "".join(c.text for c in streamed) == expected.text
    assert [t for c in streamed for t in c.token_ids] == expected.token_ids
    # n choices: a list of whole answers, or pieces naming their choice
    two = params.model_copy(update={"n": 2})
    answers = llm.generate.remote(GenerateRequest(prompt=PROMPT, sampling_params=two)).result()
    assert [(a.index, a.text, a.token_ids) for a in answers] == [
        (j, expected.text, expected.token_ids) for j in (0, 1)
    ]
    pieces = list(
        llm.options(stream=True).generate.remote(
            GenerateRequest(prompt=PROMPT, sampling_params=two, stream=True)
        )
    )
    for j in (0, 1):
        mine = [p for p in pieces if p.index == j]
        assert "".join(p.text for p in mine) == expected.text and mine[-1].finished


def _get(url, headers=None, body=None):
    """(status, JSON body) of a GET, or of a POST when `body` (bytes) is given."""
    request = urllib.request.Request(url, body, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            data = r.read()
            return r.status, json.loads(data) if "json" in r.headers["content-type"] else data
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {"Content-Type": "application/json"}


def test_models_health_and_api_key(served):
    url, _, _ = served
    assert [m.id for m in _client(url).models.list().data] == ["SmolLM2-135M-Instruct"]
    assert _get(f"{url}/health") == (200, {"status": "ok"})  # no key needed
    status, body = _get(f"{url}/v1/models")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect", "/nowhere"):
        status, body = _get(f"{url}{path}")
        assert status == 401 and body["error"]["code"] == 401, path
    assert _get(f"{url}/openapi.json", AUTH)[0] == 200
    status, body = _get(f"{url}/nowhere", AUTH)
    assert status == 404 and body["error"]["type"] == "not_found_error"
    # Authentication comes before the body is read: no schema details for strangers.
    status, body = _get(f"{url}/v1/completions", JSON, b'{"prompt": 3}')
    assert status == 401 and "prompt" not in body["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        _client(url, key="wrong").completions.create(model="SmolLM2-135M-Instruct", prompt="x")


def test_bad_requests_get_openai_errors(served, smollm2_path):
    url, _, _ = served
    client = _client(url)
    ok = {"model": "SmolLM2-135M-Instruct", "prompt": "hello", "max_tokens": 4}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(**{**ok, "model": "gpt-4"})
    for stream in (False, True):  # a stream fails before it starts: a real 400
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(**ok, temperature=-1, stream=stream)
        with pytest.raises(openai.BadRequestError, match="more than max_model_len"):
            client.completions.create(**{**ok, "prompt": "word " * 600}, stream=stream)
    with pytest.raises(openai.BadRequestError, match="n"):
        client.completions.create(**ok, n=129)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(**ok, best_of=3)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[])
    body = json.dumps({"prompt": "no model"}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions",
        body,
        {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and error["code"] == 400 and "model" in error["message"]
    for raw in (b'{"model": "SmolLM2-135M-Instruct", "prompt": "\xff\xfe"}', b'{"model": '):
        status, body = _get(f"{url}/v1/completions", {**AUTH, **JSON}, raw)  # not UTF-8 / JSON
        assert status == 400 and body["error"]["type"] == "invalid_request_error", raw
    lone = {"role": "user", "content": "\udfff"}  # JSON can carry lone surrogates
    for path, body, field in [
        ("/v1/completions", {**ok, "max_tokens": 10**6}, "max_tokens"),
        ("/v1/completions", {**ok, "top_k": 10**30}, "top_k"),
        ("/v1/completions", {**ok, "prompt": "\ud800"}, "prompt"),
        ("/v1/chat/completions", {"model": ok["model"], "messages": [lone]}, "content"),
    ]:
        status, reply = _get(f"{url}{path}", {**AUTH, **JSON}, json.dumps(body).encode())
        assert status == 400 and field in reply["error"]["message"], (field, reply)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(**ok, logit_bias={"not a token": 5})
    forced = client.completions.create(**ok, temperature=0.8, logit_bias={"42": 100})
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    assert forced.choices[0].text == tokenizer.decode([42] * ok["max_tokens"])


def test_json_schema_json_mode_and_guided_choice(served):
    """OpenAI's `response_format` and vLLM's guided fields through the real client: the
    served engine (speculating) answers exactly what the offline engine without
    speculation does, and the answers parse."""
    url, _, reference = served
    client = _client(url)
    ask = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 64}
    messages = [{"role": "user", "content": JSON_QUESTION}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    for stream in (False, True):
        out = client.chat.completions.create(
            **ask, messages=messages, response_format=schema_format, stream=stream
        )
        text = (
            "".join(c.choices[0].delta.content or "" for c in out)
            if stream
            else out.choices[0].message.content
        )
        assert text == reference["json"].outputs[0].text
        assert set(json.loads(text)) == {"city", "rainy"}
    out = client.chat.completions.create(
        **ask, messages=messages, response_format={"type": "json_object"}
    )
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    picked = client.completions.create(
        **ask, prompt="Is water wet?", extra_body={"guided_choice": ["yes", "no"]}
    )
    assert picked.choices[0].text in ("yes", "no") and picked.choices[0].finish_reason == "stop"
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError, match=r"structured_outputs\.json"):
        client.chat.completions.create(**ask, messages=messages, response_format=bad)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_tool_calls_named_required_and_auto(served):
    """The real client's tool calling: a named function and "required" give calls whose
    arguments follow the tool's schema (streamed: the same call in one delta); "auto" (the
    Hermes parser on; SmolLM2's template does not render tools) gives the text; a
    conversation carrying the call and the tool's answer goes through."""
    url, _, _ = served
    client = _client(url)
    ask = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 48}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        **ask, messages=messages, tools=[WEATHER], tool_choice=named
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and out.choices[0].finish_reason == "stop"
    assert set(json.loads(call.function.arguments)) == {"city"}
    streamed = list(
        client.chat.completions.create(
            **ask, messages=messages, tools=[WEATHER], tool_choice=named, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    (streamed_call,) = [t for d in deltas for t in d.tool_calls or []]
    assert streamed_call.function.arguments == call.function.arguments

    out = client.chat.completions.create(
        **ask, messages=messages, tools=[WEATHER], tool_choice="required"
    )
    assert out.choices[0].finish_reason == "tool_calls"
    assert all(c.function.name == "get_weather" for c in out.choices[0].message.tool_calls)

    out = client.chat.completions.create(**ask, messages=messages, tools=[WEATHER])
    assert out.choices[0].message.content and out.choices[0].message.tool_calls is None

    turns = [
        *messages,
        {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    out = client.chat.completions.create(**ask, messages=turns, tools=[WEATHER], tool_choice="none")
    assert out.choices[0].message.content and out.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="no tool is named"):
        client.chat.completions.create(
            **ask,
            messages=messages,
            tools=[WEATHER],
            tool_choice={**named, "function": {"name": "x"}},
        )


def test_full_queue_gets_429_and_leaving_clients_free_their_requests(served):
    url, llm, reference = served
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    long = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": "Tell a long story.",
        "max_tokens": 400,
        "extra_body": {"ignore_eos": True},  # so that it really is long
    }

    def stats():
        return llm.stats.remote().result()

    async def main():
        a = await client.completions.create(**long, stream=True)  # running
        b = await client.completions.create(**long, stream=True)  # running (max_num_seqs=2)
        c = asyncio.ensure_future(client.completions.create(**long, stream=True))  # waits
        await asyncio.to_thread(
            wait_for, lambda: stats()["engine"]["num_waiting"] >= 1, 30, "a waiting request"
        )
        for stream in (False, True):
            with pytest.raises(openai.RateLimitError, match="max_waiting_requests"):
                await client.completions.create(**long, stream=stream)
        assert (await a.__anext__()).choices[0].text is not None
        await a.close()  # clients leave mid-stream or before their first token
        await b.close()
        c.cancel()

    asyncio.run(main())

    def all_freed():
        s = stats()
        idle = s["num_unfinished_requests"] == 0 and s["num_live_requests"] == 0
        return s if idle and s["num_free_kv_blocks"] == s["num_kv_blocks"] else None

    final = wait_for(all_freed, 15, "the requests to be aborted and their blocks freed")
    metrics = final["metrics"]
    assert metrics["requests_abort"] >= 2 and metrics["requests_error"] >= 2  # too long
    assert metrics.get("requests_stop", 0) + metrics.get("requests_length", 0) >= 4
    assert metrics["generation_tokens"] > 0 and metrics["prompt_tokens"] > 0
    if reference["speculating"]:  # the default manifest drafts with n-grams
        assert metrics["spec_decode"]["num_drafts"] > 0


def _expected_logprobs(output):
    """[(token id, its logprob, {top-2 token id: logprob})] of an offline output."""
    completion = output.outputs[0]
    rows = []
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        top = {t: lp.logprob for t, lp in entry.items() if 1 <= lp.rank <= 2}
        rows.append((token, entry[token].logprob, top))
    return rows


def test_logprobs_equal_the_engine_without_speculation(served):
    url, _, reference = served
    client = _client(url)
    expected = _expected_logprobs(reference["logprobs"])
    tokens = [token for token, _, _ in expected]
    ask = dict(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    out = client.completions.create(**ask, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(tokens)
    rows = zip(expected, lp.token_logprobs, lp.top_logprobs, strict=True)
    for (_, logprob, top), got, got_top in rows:
        assert abs(got - logprob) < 1e-4
        assert len(got_top) == len(top) == 2
        assert sorted(got_top.values()) == pytest.approx(sorted(top.values()), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = []
    for chunk in client.completions.create(**ask, logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx([logprob for _, logprob, _ in expected], abs=1e-4)

    chat_expected = _expected_logprobs(reference["chat_logprobs"])
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [logprob for _, logprob, _ in chat_expected], abs=1e-4
    )
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    # Every output token has one entry, the EOS that ended the answer too.
    assert "".join(c.token for c in content).startswith(chat.choices[0].message.content)


def test_echo_returns_the_prompt_and_its_logprobs(served):
    """`echo` (with and without a completion, streamed or not) through the OpenAI client,
    and `prompt_logprobs` through the handle: the prompt's logprobs are the engine's."""
    url, llm, reference = served
    expected = reference["echo"]
    prompt_ids = expected.prompt_token_ids
    prompt_lp = [None] + [
        e[t].logprob for t, e in zip(prompt_ids[1:], expected.prompt_logprobs[1:], strict=True)
    ]
    output_lp = [logprob for _, logprob, _ in _expected_logprobs(expected)]
    completion = expected.outputs[0].text
    client = _client(url)
    ask = dict(model="SmolLM2-135M-Instruct", prompt=PROMPT, temperature=0, logprobs=2)

    def check(logprobs, want):
        assert logprobs[0] is None and len(logprobs) == len(want)
        assert logprobs[1:] == pytest.approx(want[1:], abs=1e-4)

    out = client.completions.create(**ask, max_tokens=MAX_TOKENS, echo=True).choices[0]
    assert out.text == PROMPT + completion
    check(out.logprobs.token_logprobs, prompt_lp + output_lp)
    assert out.logprobs.top_logprobs[0] is None and len(out.logprobs.top_logprobs[1]) == 2
    assert out.logprobs.text_offset == sorted(out.logprobs.text_offset)

    scored = client.completions.create(**ask, max_tokens=0, echo=True).choices[0]
    assert scored.text == PROMPT and scored.finish_reason == "length"
    check(scored.logprobs.token_logprobs, prompt_lp)

    text, streamed = "", []
    for chunk in client.completions.create(**ask, max_tokens=MAX_TOKENS, echo=True, stream=True):
        if chunk.choices:
            text += chunk.choices[0].text
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert text == PROMPT + completion
    check(streamed, prompt_lp + output_lp)

    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(**ask, max_tokens=0)

    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
    request = GenerateRequest(prompt=PROMPT, sampling_params=params, echo=True)
    handled = llm.generate.remote(request).result()
    assert handled.prompt == PROMPT
    assert [t.token_id for t in handled.prompt_logprobs] == prompt_ids
    check([t.logprob for t in handled.prompt_logprobs], prompt_lp)
    assert all(len(t.top) == 1 for t in handled.prompt_logprobs[1:])


def test_dropped_streams_always_free_their_requests(served):
    """Serve cancels the replica call of a client that leaves; the abort the call sends as
    it ends must not be cancelled with it (once, 5 rounds in 12 left a request running)."""
    url, llm, _ = served
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    def stats():
        return llm.stats.remote().result()

    async def drop_two(over_http: bool):
        if over_http:
            streams = [
                await client.completions.create(
                    model="SmolLM2-135M-Instruct",
                    prompt=f"Story {i}:",
                    max_tokens=400,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for i in range(2)
            ]
            for stream in streams:
                await stream.__anext__()
                await stream.close()
            return
        for i in range(2):
            stream = llm.options(stream=True).generate.remote(
                GenerateRequest(prompt=f"Story {i}:", sampling_params=long, stream=True)
            )
            await stream.__anext__()
            stream.cancel()

    for over_http in (True, False, True, False, True, True):
        asyncio.run(drop_two(over_http))
        wait_for(
            lambda: stats()["num_live_requests"] == 0 and stats()["num_unfinished_requests"] == 0,
            10,
            "both dropped streams to be aborted in the engine",
        )
    s = stats()
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]


def test_cli_generate_and_chat_against_the_server(served, capsys, monkeypatch):
    url, _, reference = served
    remote = ["--url", url, "--api-key", API_KEY, "--max-tokens", str(MAX_TOKENS)]
    main(["generate", *remote, PROMPT])
    assert capsys.readouterr().out == PROMPT + reference["completion"].outputs[0].text + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{QUESTION}\n/exit\nnever sent\n"))
    main(["chat", *remote])
    assert capsys.readouterr().out == reference["chat"].outputs[0].text + "\n"


def test_vllm_routes_content_parts_prompt_lists_and_refused_fields(served, smollm2_path):
    """vLLM's extra routes; chat content as text parts, the developer role and names; a
    list of prompts; chat_template_kwargs; fields that ask for what this server cannot do
    get a 400 naming them, unknown fields too, while no-effect ones (user) are accepted."""
    url, _, reference = served
    client = _client(url)
    model = "SmolLM2-135M-Instruct"
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    assert _get(f"{url}/version", AUTH)[1]["version"]
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    status, body = _get(
        f"{url}/tokenize", {**AUTH, **JSON}, json.dumps({"model": model, "prompt": PROMPT}).encode()
    )
    assert (
        status == 200
        and body["tokens"] == tokenizer.encode(PROMPT)
        and body["count"] == len(body["tokens"])
    )
    chat = {"model": model, "messages": [{"role": "user", "content": QUESTION}]}
    status, body = _get(f"{url}/tokenize", {**AUTH, **JSON}, json.dumps(chat).encode())
    assert body["tokens"] == reference["chat"].prompt_token_ids
    status, body = _get(
        f"{url}/detokenize",
        {**AUTH, **JSON},
        json.dumps({"model": model, "tokens": body["tokens"]}).encode(),
    )
    assert status == 200 and body["prompt"] == tokenizer.decode(reference["chat"].prompt_token_ids)
    status, body = _get(
        f"{url}/detokenize",
        {**AUTH, **JSON},
        json.dumps({"model": model, "tokens": [10**9]}).encode(),
    )
    assert status == 400 and "tokens" in body["error"]["message"]

    greedy = dict(model=model, max_tokens=MAX_TOKENS, temperature=0)
    parts = [{"type": "text", "text": QUESTION}]
    named = [{"role": "user", "content": parts, "name": "ada"}]
    out = client.chat.completions.create(
        **greedy, messages=named, user="u1", extra_body={"top_k": 0}
    )
    assert out.choices[0].message.content == reference["chat"].outputs[0].text
    developer = client.chat.completions.create(
        **greedy, messages=[{"role": "developer", "content": "Answer briefly."}, *chat["messages"]]
    )
    assert developer.choices[0].message.content  # the template took it (as a system turn)
    both = client.completions.create(**greedy, prompt=[PROMPT, QUESTION])
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == reference["completion"].outputs[0].text
    assert both.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) + len(
        tokenizer.encode(QUESTION)
    )

    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}  # SmolLM2's ignores it
    out = client.chat.completions.create(**greedy, messages=chat["messages"], extra_body=kwargs)
    assert out.choices[0].message.content == reference["chat"].outputs[0].text
    for field, extra in [
        ("functions", {"functions": [{"name": "f", "parameters": {}}]}),
        ("prediction", {"prediction": {"type": "content", "content": "x"}}),
        ("chat_template_kwargs", {"extra_body": {"chat_template_kwargs": {"messages": []}}}),
        ("not_a_field", {"extra_body": {"not_a_field": 1}}),
    ]:
        with pytest.raises(openai.BadRequestError, match=field):
            client.chat.completions.create(**greedy, messages=chat["messages"], **extra)
    with pytest.raises(openai.BadRequestError, match="image_url"):
        image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
        client.chat.completions.create(**greedy, messages=[{"role": "user", "content": image}])


def _scrape(url):
    from prometheus_client.parser import text_string_to_metric_families

    status, body = _get(f"{url}/metrics")  # no key: scrapers send none, as with vLLM
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "replica")))
            samples[key] = samples.get(key, 0) + s.value
    return samples


def test_metrics_with_vllm_names_scraped_during_load(served):
    url, _, reference = served
    client = _client(url)
    model = (("model_name", "SmolLM2-135M-Instruct"),)
    before = _scrape(url)
    stream = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        stream=True,
    )  # fmt: skip
    next(iter(stream))
    during = _scrape(url)  # one replica, so this request is in its gauges
    assert during[("vllm:num_requests_running", model)] >= 1
    text = "".join(c.choices[0].text for c in stream)
    assert text
    after = _scrape(url)

    def grew(name, labels=model):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    stop = tuple(sorted((*model, ("finished_reason", "length"))))
    assert grew("vllm:request_success_total", stop) >= 1
    assert grew("vllm:generation_tokens_total") >= MAX_TOKENS
    assert grew("vllm:prompt_tokens_total") >= len(reference["completion"].prompt_token_ids)
    for histogram in ("time_to_first_token", "e2e_request_latency"):
        assert grew(f"vllm:{histogram}_seconds_count") >= 1
    assert ("vllm:kv_cache_usage_perc", model) in after
    if reference["speculating"]:
        assert grew("vllm:spec_decode_num_draft_tokens_total") > 0
        first = tuple(sorted((*model, ("position", "0"))))
        assert ("vllm:spec_decode_num_accepted_tokens_per_pos_total", first) in after
