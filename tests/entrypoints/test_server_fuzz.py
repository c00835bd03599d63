"""Fuzz the server app with malformed and out-of-range requests (hypothesis, in-process):
never a 5xx, every error in OpenAI's shape and small, and the server still serves after.
Derandomized: `make test` runs 300 examples, `make soak` (--soak) 6,000."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from conftest import series_size
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_helpers import CHAT_TEMPLATE, KV, AppClient, assert_error

from fleetllm.engine.async_engine import AsyncLLMEngine
from fleetllm.entrypoints.openai.api_server import build_app

ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]

junk = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8)


def maybe(good: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly plausible values (often out of range), sometimes anything at all."""
    return st.one_of(good, good, junk)


token_ids = st.lists(st.integers(-3, 700), max_size=8)
sampling = {
    "model": maybe(st.sampled_from(["tiny", "other", ""])),
    "n": maybe(st.integers(-1, 3)),
    "temperature": maybe(st.floats(-2, 3)),
    "top_p": maybe(st.floats(-0.5, 1.5)),
    "top_k": maybe(st.integers(-3, 2 ** 40)),
    "min_p": maybe(st.floats(-0.5, 1.5)),
    "seed": maybe(st.integers(-(2 ** 70), 2 ** 70)),
    "presence_penalty": maybe(st.floats(-3, 3)),
    "frequency_penalty": maybe(st.floats(-3, 3)),
    "repetition_penalty": maybe(st.floats(-1, 3)),
    "stop": maybe(st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3)),
    "stop_token_ids": maybe(token_ids),
    "ignore_eos": maybe(st.booleans()),
    "min_tokens": maybe(st.integers(-2, 40)),
    "stream": maybe(st.booleans()),
    "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "logit_bias": junk,
    # structured outputs: malformed constraints are 400s, from the server or the engine
    "response_format": maybe(st.sampled_from([
        {"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}])
        | st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema":
                                 st.fixed_dictionaries({"name": st.just("x"),
                                                        "schema": junk})})),
    "guided_regex": maybe(st.text(max_size=6)),
    "guided_choice": maybe(st.lists(st.text(max_size=4), max_size=3)),
    "guided_json": junk,
    "structured_outputs": maybe(st.dictionaries(st.sampled_from(
        ["json", "regex", "choice", "grammar", "json_object"]), junk, max_size=2)),
}
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", "bad name"])}, optional={"parameters": junk})})
completion = st.fixed_dictionaries({}, optional={
    **sampling,
    "prompt": maybe(st.text(max_size=40) | token_ids | st.lists(st.text(max_size=6),
                                                                 max_size=3)
                    | st.lists(token_ids, max_size=3)),
    "max_tokens": maybe(st.integers(-2, 40) | st.none()),
    "logprobs": maybe(st.integers(-2, 25)),
    "echo": maybe(st.booleans()),
    "best_of": maybe(st.integers(-1, 3)),
    "suffix": junk,
})
message = st.fixed_dictionaries({
    "role": maybe(st.sampled_from(["system", "user", "assistant", "wizard"])),
    "content": maybe(st.text(max_size=30) | st.lists(st.fixed_dictionaries({
        "type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8)}),
        max_size=2))})
chat = st.fixed_dictionaries({}, optional={
    **sampling,
    "messages": maybe(st.lists(message, max_size=3)),
    "max_tokens": maybe(st.integers(-2, 40) | st.none()),
    "max_completion_tokens": maybe(st.integers(-2, 40)),
    "logprobs": maybe(st.booleans()),
    "top_logprobs": maybe(st.integers(-2, 25)),
    "tools": maybe(st.lists(tool, max_size=2)),
    "tool_choice": maybe(st.sampled_from(["none", "auto", "required", {
        "type": "function", "function": {"name": "f"}}])),
})
tokenize = st.fixed_dictionaries({}, optional={
    "prompt": maybe(st.text(max_size=20)), "messages": maybe(st.lists(message, max_size=2)),
    "tokens": maybe(token_ids), "add_special_tokens": maybe(st.booleans())})
URL_CHARS = st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#%")
content_types = st.sampled_from([None, "application/json", "text/plain",
                                 "application/json; charset=utf-8",
                                 "application/x-www-form-urlencoded", "application/jsonx"])


@st.composite
def requests(draw) -> tuple[str, str, bytes, dict[str, str]]:
    kind = draw(st.sampled_from(["completion", "chat", "tokenize", "raw", "route"]))
    method, path, ctype = "POST", draw(st.sampled_from(ENDPOINTS)), "application/json"
    if kind == "completion":
        path, body = "/v1/completions", json.dumps(draw(completion)).encode()
    elif kind == "chat":
        path, body = "/v1/chat/completions", json.dumps(draw(chat)).encode()
    elif kind == "tokenize":
        path = draw(st.sampled_from(["/tokenize", "/detokenize"]))
        body = json.dumps(draw(tokenize)).encode()
    elif kind == "raw":  # not JSON, not an object, or under the wrong content type
        body = draw(st.binary(max_size=60) | junk.map(lambda v: json.dumps(v).encode()))
        ctype = draw(content_types)
    else:
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "POST", "PATCH"]))
        path = draw(st.sampled_from([*ENDPOINTS, "/v1/models", "/v1", "/metrics/x",
                                     "/v1/completions/1"])
                    | st.text(URL_CHARS, max_size=10).map(lambda t: "/" + t))
        body = b""
    return method, path, body, ({"content-type": ctype} if ctype else {})


@pytest.fixture(scope="module")
def app(tiny_models):
    model = tiny_models["llama_gqa"]
    # A short context keeps the valid requests among the fuzz cheap.
    engine = AsyncLLMEngine.from_engine_args(str(model), kv_cache_memory=KV, max_model_len=48)
    client = AppClient(build_app(engine, ["tiny"], chat_template=CHAT_TEMPLATE))
    yield client
    client.close()
    engine.shutdown()


def check(response) -> str:
    """What kind of answer it was; fails on a 5xx or a malformed error."""
    status = response.status_code
    assert status < 500, (status, response.text[:300])
    if status >= 400:
        assert_error(response, status)
        return "error"
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        for event in events[:-1]:
            body = json.loads(event)
            assert "error" not in body, body
        return "stream"
    if response.content:
        json.loads(response.content)
    return "ok"


@pytest.mark.soak
def test_fuzzed_requests_never_5xx_and_errors_keep_their_shape(app, soak):
    outcomes: Counter[str] = Counter()
    examples = series_size(soak, 300, 6000)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(requests())
    def one(request):
        method, path, body, headers = request
        outcomes[check(app.request(method, path, content=body or None, headers=headers))] += 1

    one()
    print(f"{examples} examples: {dict(outcomes)}")
    assert outcomes["error"] >= 0.75 * examples, outcomes  # mostly malformed, as meant
    assert app.request("GET", "/health").status_code == 200
    r = app.request("POST", "/v1/completions", json={"model": "tiny", "prompt": "hello",
                                                     "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
