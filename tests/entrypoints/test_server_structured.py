"""Structured outputs and tool calls through the server (issue #20), driven by the official
openai client: response_format (a Pydantic model through `parse`, json_schema, json_object),
vLLM's structured_outputs and guided_* fields, tools with tool_choice required / named /
auto (--enable-auto-tool-choice --tool-call-parser hermes), streamed and not, n=2, on
/v1/completions and /v1/chat/completions; malformed constraints are 400s. The bundled demo
model (trained, so that constrained JSON ends in a few dozen tokens rather than wandering in
whitespace as a random checkpoint's does), with the engine-core process (the default) and
--disable-frontend-multiprocessing."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from serving_helpers import server_env, serving

from fleetllm.engine.arg_utils import DEMO_MODEL
from fleetllm.entrypoints.openai.local_server import LocalServer

NAME = "demo"
# Renders the tools and replayed calls, so a test can see that they reach the template.
TOOLS_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }}"
    "{{ t['function']['parameters'] | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"utc": {"type": "boolean"}},
             "required": ["utc"], "additionalProperties": False}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLING = {"temperature": 0.7, "seed": 0, "max_tokens": 320}
REGEX = r"[a-c]{3}-(yes|no)"
CHOICES = ["def", "class", "import"]


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    sunny: bool


@pytest.fixture(scope="module", params=["core-process", "in-process"])
def server(request, tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    extra = [] if request.param == "core-process" else ["--disable-frontend-multiprocessing"]
    srv = LocalServer([str(DEMO_MODEL), "--served-model-name", NAME, "--chat-template",
                       str(template), "--kv-cache-memory", str(64 << 20),
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes", *extra],
                      env=server_env())
    with serving(srv):
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat_stream(client, n: int = 1, **kwargs) -> dict[int, dict]:
    """A streamed chat reassembled per choice: content, tool calls (by index: id, name,
    arguments concatenated) and finish_reason."""
    out = {i: {"content": "", "calls": [], "finish_reason": None} for i in range(n)}
    for chunk in client.chat.completions.create(model=NAME, stream=True, n=n, **kwargs):
        for c in chunk.choices:
            choice = out[c.index]
            choice["content"] += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.id is not None:
                    assert d.index == len(choice["calls"]) and d.type == "function"
                    choice["calls"].append({"id": d.id, "name": d.function.name,
                                            "arguments": ""})
                else:
                    assert d.function.name is None
                choice["calls"][d.index]["arguments"] += d.function.arguments or ""
            if c.finish_reason is not None:
                choice["finish_reason"] = c.finish_reason
    return out


def check_calls(calls: list, names: set[str]) -> list[tuple[str, dict]]:
    """Each call: a chatcmpl-tool id, one of `names`, arguments valid for its schema."""
    read = []
    for call in calls:
        call_id, name, arguments = (call.id, call.function.name, call.function.arguments) \
            if not isinstance(call, dict) else (call["id"], call["name"], call["arguments"])
        assert call_id.startswith("chatcmpl-tool-") and name in names
        args = json.loads(arguments)
        jsonschema.validate(args, PARAMS[name])
        read.append((name, args))
    return read


# ---------------------------------------------------------------- response_format


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(model=NAME, messages=MESSAGES,
                                               response_format=Weather, **SAMPLING)
    [choice] = completion.choices
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Weather)
    assert Weather.model_validate_json(choice.message.content) == choice.message.parsed


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_and_json_object_with_n_2(client, stream):
    schema = Weather.model_json_schema()
    for fmt, check in (
            ({"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
             lambda v: jsonschema.validate(v, schema)),
            ({"type": "json_object"}, lambda v: isinstance(v, dict) or pytest.fail(v))):
        kwargs = {"messages": MESSAGES, "response_format": fmt, **SAMPLING}
        if stream:
            texts = [(c["content"], c["finish_reason"])
                     for c in chat_stream(client, n=2, **kwargs).values()]
        else:
            out = client.chat.completions.create(model=NAME, n=2, **kwargs)
            texts = [(c.message.content, c.finish_reason) for c in out.choices]
        assert len(texts) == 2
        for text, reason in texts:
            if fmt["type"] == "json_schema" or reason == "stop":  # any object may run long
                assert reason == "stop", text
                check(json.loads(text))


def completion_choices(client, kwargs: dict, stream: bool) -> list[tuple[str, str | None]]:
    """(text, finish_reason) per choice, in index order: whole, or its deltas reassembled."""
    if not stream:
        out = client.completions.create(**kwargs)
        return [(c.text, c.finish_reason) for c in sorted(out.choices, key=lambda c: c.index)]
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    return [(texts[i], reasons[i]) for i in sorted(texts)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields, valid", [
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
    ({"guided_json": WEATHER_PARAMS},
     lambda t: jsonschema.validate(json.loads(t), WEATHER_PARAMS) is None),
    ({"structured_outputs": {"json": json.dumps(WEATHER_PARAMS)},
      "guided_decoding_backend": "auto"},
     lambda t: jsonschema.validate(json.loads(t), WEATHER_PARAMS) is None),
    ({"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, lambda t: re.fullmatch(r"x\d\d", t)),
])
def test_completions_follow_the_constraint(client, fields, valid, stream):
    """Two prompts x n=2: four choices, each valid and finished by its grammar."""
    kwargs = {"model": NAME, "prompt": ["def f(x):", "import os\n"], "n": 2,
              "extra_body": fields, **SAMPLING}
    choices = completion_choices(client, kwargs, stream)
    assert len(choices) == 4
    for text, reason in choices:
        assert reason == "stop" and valid(text), (text, reason)


def test_chat_with_a_regex_streams_what_it_answers_whole(client):
    kwargs = {"messages": MESSAGES, "extra_body": {"guided_regex": REGEX}, **SAMPLING}
    whole = client.chat.completions.create(model=NAME, n=2, **kwargs)
    streamed = chat_stream(client, n=2, **kwargs)
    for c in whole.choices:
        assert re.fullmatch(REGEX, c.message.content) and c.finish_reason == "stop"
        assert streamed[c.index]["content"] == c.message.content


# ---------------------------------------------------------------- tools


def test_required_tool_calls_validate_and_stream_the_same(client):
    kwargs = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", **SAMPLING}
    whole = client.chat.completions.create(model=NAME, n=3, **kwargs)
    streamed = chat_stream(client, n=3, **kwargs)
    called = 0
    for c in whole.choices:
        s = streamed[c.index]
        assert s["finish_reason"] == c.finish_reason
        if c.finish_reason == "length":  # the model may list calls until max_tokens
            assert c.message.tool_calls is None
            continue
        called += 1
        assert c.finish_reason == "tool_calls" and c.message.content is None
        calls = check_calls(c.message.tool_calls, set(PARAMS))
        assert len(calls) >= 1 and check_calls(s["calls"], set(PARAMS)) == calls
        assert s["content"] == ""
    assert called >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_call(client, stream):
    kwargs = {"messages": MESSAGES, "tools": TOOLS, **SAMPLING,
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    if stream:
        choices = [(c["calls"], c["finish_reason"], c["content"] or None)
                   for c in chat_stream(client, n=2, **kwargs).values()]
    else:
        out = client.chat.completions.create(model=NAME, n=2, **kwargs)
        choices = [(c.message.tool_calls, c.finish_reason, c.message.content)
                   for c in out.choices]
    for calls, reason, content in choices:
        assert reason == "tool_calls" and content is None
        [(name, _)] = check_calls(calls, {"get_weather"})


class GetWeather(BaseModel):
    city: Literal["Paris", "Rome"]
    days: int


def test_parse_with_a_pydantic_function_tool(client):
    """The client's strict function tools: the named call's arguments come back parsed."""
    tool = openai.pydantic_function_tool(GetWeather)
    out = client.chat.completions.parse(
        model=NAME, messages=MESSAGES, tools=[tool], **SAMPLING,
        tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    [choice] = out.choices
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


HERMES_CALL = (r'<tool_call>\{"name": "get_time", "arguments": \{"utc": (true|false)\}\}'
               r'</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_reads_hermes_calls(client, stream):
    """tool_choice "auto" (the default with tools): the hermes parser reads the model's
    calls. A regex makes this model write one."""
    kwargs = {"messages": MESSAGES, "tools": TOOLS, **SAMPLING,
              "extra_body": {"guided_regex": r"Sure\. " + HERMES_CALL}}
    if stream:
        [c] = chat_stream(client, **kwargs).values()
        calls, reason, content = c["calls"], c["finish_reason"], c["content"]
    else:
        [choice] = client.chat.completions.create(model=NAME, **kwargs).choices
        calls, reason = choice.message.tool_calls, choice.finish_reason
        content = choice.message.content
    assert reason == "tool_calls" and content == "Sure. "
    [(name, args)] = check_calls(calls, {"get_time"})
    assert name == "get_time" and isinstance(args["utc"], bool)


def test_the_template_gets_tools_and_replayed_calls(server):
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny"}]
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages,
                                                     "tools": TOOLS}).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "<|tools|>get_weather{" in text and "get_time" in text
    assert '<tool_call>get_weather{"city": "Rome", "days": 2}</tool_call>' in text
    assert "<|tool|>sunny" in text
    out = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 3})
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["prompt_tokens"] == len(ids)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("body, param, words", [
    ({"guided_regex": "(unclosed"}, None, "regex"),
    ({"guided_json": {"type": "nonsense"}}, None, "nonsense"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_grammar": "root ::= ("}, None, "grammar"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "response_format, guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"},
     "guided_decoding_backend", "outlines"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "unknown field"),
    # past MAX_CONSTRAINT_CHARS: a 300 KB regex compiled for 18 s on the grammar thread
    ({"guided_regex": "a" * 300_000}, "guided_regex", "300,000 characters"),
    ({"guided_choice": ["x" * 1000] * 70}, "guided_choice", "at most 65,536"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "enum": ["y" * 70_000]}}}}, "response_format", "json: 70,"),
])
def test_malformed_constraints_are_400s_naming_the_problem(server, body, param, words):
    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        r = httpx.post(f"{server.url}{path}", json={**base, **body, "max_tokens": 5},
                       timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert words in error["message"], error
        if param is not None:
            assert error["param"] == param, error
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("body, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "'nope' is not in tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
     "guided_regex, tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "nonsense"}}}], "tool_choice": "required"}, "nonsense"),
])
def test_tool_errors_are_400s(server, body, words):
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"messages": MESSAGES, **body, "max_tokens": 5})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.json()


def test_auto_tool_choice_needs_the_flags(tmp_path):
    """Without --enable-auto-tool-choice: vLLM's 400 for "auto" (the default with tools);
    "none", "required" and named calls still work."""
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    with LocalServer([str(DEMO_MODEL), "--chat-template", str(template),
                      "--disable-frontend-multiprocessing", "--kv-cache-memory",
                      str(32 << 20)], env=server_env()) as srv:
        for choice in ({}, {"tool_choice": "auto"}):
            r = httpx.post(f"{srv.url}/v1/chat/completions",
                           json={"messages": MESSAGES, "tools": TOOLS, **choice})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == (
                '"auto" tool choice requires --enable-auto-tool-choice and '
                '--tool-call-parser to be set')
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={
            "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 3})
        assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]


def test_bench_serve_with_a_share_of_grammar_requests(server):
    """--structured-fraction 0.5: half the requests follow the schema; TPOT per class."""
    from fleetllm.benchmarks.serve import main

    result = main(["--base-url", server.url, "--num-prompts", "8", "--input-len", "16",
                   "--output-len", "24", "--structured-fraction", "0.5", "--quiet"])
    assert result["failed"] == 0, result["errors"]
    assert result["plain_completed"] == result["structured_completed"] == 4
    assert result["plain_mean_tpot_ms"] > 0 and result["structured_mean_tpot_ms"] > 0
    assert result["plain_output_tokens"] == 4 * 24  # ignore_eos: all of output_len


@pytest.mark.parametrize("stream", [False, True])
def test_random_constraints_streamed_and_whole(client, stream):
    """Random JSON schemas, regexes and choices (tests/structured_helpers.py) through the
    server, sampled with n=2: every choice finishes by its grammar and validates, streamed
    (the deltas reassembled) or whole."""
    import random

    from structured_helpers import check_output, random_constraint

    from fleetllm import StructuredOutputsParams

    rng = random.Random(7 + stream)
    for i in range(16):
        so = random_constraint(rng)
        field = ({"json": so.json, "disable_any_whitespace": True} if so.json is not None
                 else {"regex": so.regex} if so.regex is not None else {"choice": so.choice})
        kwargs = {"model": NAME, "prompt": "def parse(text):\n    return ", "n": 2,
                  "temperature": 1.0, "seed": i, "max_tokens": 400,
                  "extra_body": {"structured_outputs": field}}
        choices = completion_choices(client, kwargs, stream)
        assert len(choices) == 2
        for text, reason in choices:
            assert reason == "stop", (field, text)
            check_output(StructuredOutputsParams(**field), text)
