"""Server defects found in review (issue 16, "Hardening II", items 8 and 10-14), in-process:
each test failed before its fix. Logprob tokens with SentencePiece tokenizers (item 11) are
in test_server_logprobs.py; the open-file limit and `bench serve` against a real server are
in test_server.py."""

from __future__ import annotations

import asyncio
import gc
import json
import resource
import weakref

import httpx
import pytest
from serving_helpers import CHAT_TEMPLATE, KV, AppClient, assert_error

from fleetllm.engine.async_engine import AsyncLLMEngine
from fleetllm.engine.async_stream import RequestStream
from fleetllm.engine.outputs import CompletionOutput, RequestOutput
from fleetllm.entrypoints.openai import api_server
from fleetllm.entrypoints.openai.api_server import build_app

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = {"prompt": "hello", "max_tokens": 3}
CHAT_HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
NEVER = "\x00" * 4  # a stop string no output contains: the request may end early


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_gqa"]


@pytest.fixture(scope="module")
def engine(model):
    eng = AsyncLLMEngine.from_engine_args(str(model), kv_cache_memory=KV, max_model_len=256)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def app(engine):
    client = AppClient(build_app(engine, ["tiny"], chat_template=CHAT_TEMPLATE))
    yield client
    client.close()


def events(response) -> list:
    """The parsed `data:` events of a server-sent-events body, [DONE] last."""
    assert response.status_code == 200, response.text[:300]
    data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


# ---------------------------------------------------------------- 8: merge on put


class _NoEngine:
    def abort(self, request_id, error=None):
        pass


def cumulative(n: int, finished: bool = False) -> RequestOutput:
    ids = list(range(n))
    completion = CompletionOutput(0, "x" * n, ids, None, None,
                                  finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1], None, [completion], finished)


def test_a_slow_reader_holds_one_pending_output_and_loses_nothing():
    async def run():
        stream = RequestStream("r", _NoEngine())
        refs = []
        for n in range(1, 201):  # 200 steps the reader does not pick up
            out = cumulative(n)
            refs.append(weakref.ref(out))
            stream.put(out)
            del out
        await asyncio.sleep(0)  # the engine loop's deliveries run
        gc.collect()
        assert sum(r() is not None for r in refs) == 1  # only the newest is held
        first = await stream.__anext__()
        assert first.outputs[0].delta_token_ids == list(range(200))
        stream.put(cumulative(201))
        stream.put(cumulative(203, finished=True))
        stream.put(RuntimeError("after the end"))  # a finished output is never lost to it
        await asyncio.sleep(0)
        last = await stream.__anext__()
        assert last.finished and last.outputs[0].delta_token_ids == [200, 201, 202]
        assert last.outputs[0].delta_text == "xxx"
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()

        failing = RequestStream("f", _NoEngine())
        failing.put(cumulative(3))
        failing.put(cumulative(5))
        failing.put(RuntimeError("engine died"))
        await asyncio.sleep(0)
        out = await failing.__anext__()  # the outputs first, merged, then the error
        assert out.outputs[0].delta_token_ids == [0, 1, 2, 3, 4]
        with pytest.raises(RuntimeError, match="engine died"):
            await failing.__anext__()

    asyncio.run(run())


# ---------------------------------------------------------------- 10: no finish_reason "error"


@pytest.fixture(scope="module")
def small_pool(model):
    """4 KV blocks of 16 tokens."""
    eng = AsyncLLMEngine.from_engine_args(str(model), num_gpu_blocks_override=4, block_size=16)
    client = AppClient(build_app(eng, ["tiny"]))
    yield client
    client.close()
    eng.shutdown()


def test_samples_that_can_never_fit_the_pool_are_refused_with_a_400_saying_why(small_pool):
    body = {"prompt": list(range(3, 43)), "n": 2, "max_tokens": 40, "ignore_eos": True}
    for stream in (False, True):
        # the engine's 400 names the field at fault (issue 70: it was "param": null)
        error = assert_error(small_pool.request("POST", COMPLETIONS,
                                                json={**body, "stream": stream}), 400, "n")
        assert "2 samples of 80 tokens" in error["message"]
        assert "the whole pool has 4" in error["message"]


def test_a_request_that_fails_in_the_engine_is_an_error_never_a_finish_reason(small_pool):
    # Admitted (it may stop early), then its two samples outgrow the pool in the engine.
    body = {"prompt": list(range(3, 33)), "n": 2, "max_tokens": 40, "ignore_eos": True,
            "stop": NEVER, "temperature": 1.0, "seed": 0}
    error = assert_error(small_pool.request("POST", COMPLETIONS, json=body), 500)
    assert "cannot be scheduled" in error["message"] and "4 blocks" in error["message"]
    chunks = events(small_pool.request("POST", COMPLETIONS, json={**body, "stream": True}))
    assert "cannot be scheduled" in chunks[-1]["error"]["message"]
    assert chunks[-1]["error"]["code"] == 500
    assert all(c["finish_reason"] != "error" for e in chunks[:-1] for c in e["choices"])
    r = small_pool.request("POST", COMPLETIONS, json={"prompt": [5, 6], "max_tokens": 2})
    assert r.status_code == 200, r.text  # the server carries on


# ---------------------------------------------------------------- 12: no field silently ignored


@pytest.mark.parametrize("path, extra, param", [
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
    (COMPLETIONS, {"suffix": "end"}, "suffix"),
    (COMPLETIONS, {"logit_bias": {"5": 1.0}}, "logit_bias"),
])
def test_unsupported_fields_are_a_400_naming_them(app, path, extra, param):
    base = CHAT_HI if path == CHAT else HI
    error = assert_error(app.request("POST", path, json={**base, **extra}), 400, param)
    assert "not supported" in error["message"] or "only text" in error["message"]


@pytest.mark.parametrize("path, extra, param", [
    (COMPLETIONS, {"temprature": 0.5}, "temprature"),
    (CHAT, {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "nam": "x"}]}, "messages.0.nam"),
    (CHAT, {"stream": True, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x"),
    ("/tokenize", {"prompt": "hi", "add_bos": True}, "add_bos"),
])
def test_unknown_fields_are_a_400_naming_them(app, path, extra, param):
    base = {"/tokenize": {}, CHAT: CHAT_HI}.get(path, HI)
    error = assert_error(app.request("POST", path, json={**base, **extra}), 400, param)
    assert "unknown field" in error["message"] and param in error["message"]


def test_fields_that_ask_for_nothing_or_change_nothing_are_accepted(app):
    harmless = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "seed": 3,
                "service_tier": "auto", "tools": [], "tool_choice": "none",
                "response_format": {"type": "text"}, "parallel_tool_calls": True,
                "logit_bias": {}, "stream": True,
                "stream_options": {"include_usage": True, "include_obfuscation": False},
                "messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "yo", "refusal": None,
                              "tool_calls": None, "annotations": []},
                             {"role": "user", "content": "again"}]}
    chunks = events(app.request("POST", CHAT, json={**CHAT_HI, **harmless}))
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    r = app.request("POST", COMPLETIONS, json={**HI, "user": "u", "suffix": None})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- 13: vLLM's validation


def test_top_logprobs_needs_logprobs_and_stream_options_needs_stream(app):
    for logprobs in (False, None):
        body = {**CHAT_HI, "top_logprobs": 2, **({} if logprobs is None else
                                                  {"logprobs": logprobs})}
        assert_error(app.request("POST", CHAT, json=body), 400, "top_logprobs")
    for path, base in ((COMPLETIONS, HI), (CHAT, CHAT_HI)):
        body = {**base, "stream_options": {"include_usage": True}}
        assert_error(app.request("POST", path, json=body), 400, "stream_options")
        assert_error(app.request("POST", path, json={**body, "stream": False}), 400,
                     "stream_options")


def test_max_completion_tokens_overflow_names_that_field(app):
    body = {**CHAT_HI, "max_tokens": None, "max_completion_tokens": 300}
    error = assert_error(app.request("POST", CHAT, json=body), 400, "max_completion_tokens")
    assert "max_completion_tokens" in error["message"]
    error = assert_error(app.request("POST", CHAT, json={**CHAT_HI, "max_tokens": 300}), 400,
                         "max_tokens")


def test_echo_with_max_tokens_0_scores_the_prompt(app, engine):
    prompt = "The quick brown fox"
    ids = engine.tokenizer.encode(prompt)
    body = {"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 2,
            "temperature": 0}
    choice = (r := app.request("POST", COMPLETIONS, json=body)).json()["choices"][0]
    assert r.status_code == 200, r.text
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == prompt
    assert lp["token_logprobs"][0] is None and all(x <= 0 for x in lp["token_logprobs"][1:])
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(ids))]
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                                 "total_tokens": len(ids)}
    # Without logprobs: the prompt and nothing else; streamed: the same, in one chunk.
    plain = app.request("POST", COMPLETIONS, json={**body, "logprobs": None}).json()
    assert plain["choices"][0]["text"] == prompt
    chunks = events(app.request("POST", COMPLETIONS, json={**body, "stream": True}))
    assert [c["choices"][0]["text"] for c in chunks] == [prompt]
    assert chunks[0]["choices"][0]["logprobs"] == lp
    assert_error(app.request("POST", COMPLETIONS, json={**body, "echo": False}), 400,
                 "max_tokens")


# ---------------------------------------------------------------- 14: operations


def test_stream_chunks_leave_out_usage_and_role_until_they_have_them(app):
    for path, base in ((CHAT, CHAT_HI), (COMPLETIONS, HI)):
        for usage in (True, False):
            body = {**base, "stream": True, "stream_options": {"include_usage": usage}}
            chunks = events(app.request("POST", path, json=body))
            with_usage = [c for c in chunks if "usage" in c]
            assert with_usage == (chunks[-1:] if usage else [])
            assert all(c["usage"] is not None for c in with_usage)
            deltas = [ch["delta"] for c in chunks for ch in c["choices"] if "delta" in ch]
            assert all("role" not in d for d in deltas[1:])
            if path == CHAT:
                assert deltas[0]["role"] == "assistant"


def test_cors_preflight_is_answered_before_the_api_key(engine):
    client = AppClient(build_app(engine, ["tiny"], api_key="k"))
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    try:
        r = client.request("OPTIONS", COMPLETIONS, headers=preflight)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
        r = client.request("POST", COMPLETIONS, json=HI, headers={"Origin": "http://x"})
        assert_error(r, 401)  # still refused, but a browser may read why
        assert r.headers["access-control-allow-origin"] == "*"
    finally:
        client.close()
    only = AppClient(build_app(engine, ["tiny"], http=api_server.HTTPOptions(
        allowed_origins=["http://ui.example"], allow_credentials=True)))
    try:
        r = only.request("OPTIONS", COMPLETIONS, headers=preflight)
        assert r.headers["access-control-allow-origin"] == "http://ui.example"
        assert r.headers["access-control-allow-credentials"] == "true"
        r = only.request("OPTIONS", COMPLETIONS, headers={**preflight, "Origin": "http://evil"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    finally:
        only.close()


def test_x_request_id_names_the_request_and_is_echoed(engine):
    client = AppClient(build_app(engine, ["tiny"], chat_template=CHAT_TEMPLATE,
                                 http=api_server.HTTPOptions(enable_request_id_headers=True)))
    try:
        r = client.request("POST", COMPLETIONS, json=HI, headers={"X-Request-Id": "abc-1"})
        assert r.headers["x-request-id"] == "abc-1" and r.json()["id"] == "cmpl-abc-1"
        r = client.request("POST", CHAT, json={**CHAT_HI, "stream": True},
                           headers={"X-Request-Id": "abc-2"})
        assert r.headers["x-request-id"] == "abc-2"
        assert {c["id"] for c in events(r)} == {"chatcmpl-abc-2"}
        r = client.request("POST", COMPLETIONS, json=HI)  # none sent: one is made up
        assert r.json()["id"] == f"cmpl-{r.headers['x-request-id']}"
        assert client.request("GET", "/health").headers["x-request-id"]

        async def same_id_twice():  # clients reuse ids: the engine's stay unique
            return await asyncio.gather(*(client.client.post(
                COMPLETIONS, json={**HI, "max_tokens": 8}, headers={"X-Request-Id": "dup"})
                for _ in range(2)))

        assert [r.status_code for r in client.run(same_id_twice())] == [200, 200]
        r = client.request("POST", COMPLETIONS, json=HI, headers={"X-Request-Id": "x" * 300})
        assert_error(r, 400, "X-Request-Id")
    finally:
        client.close()
    plain = AppClient(build_app(engine, ["tiny"]))  # without the flag: used, not echoed
    try:
        r = plain.request("POST", COMPLETIONS, json=HI, headers={"X-Request-Id": "abc-3"})
        assert r.json()["id"] == "cmpl-abc-3" and "x-request-id" not in r.headers
    finally:
        plain.close()


def test_the_open_file_soft_limit_is_raised_to_the_hard_limit():
    from fleetllm.entrypoints.openai.launcher import raise_open_file_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 256:
        pytest.skip(f"needs a finite hard limit above 256, not {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        assert raise_open_file_limit() == (256, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
        assert raise_open_file_limit() == (hard, hard)  # already there: nothing to do
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_serve_flags_for_cors_and_request_ids():
    from fleetllm.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers) == \
        (["*"], ["*"], ["*"])
    assert not args.allow_credentials and not args.enable_request_id_headers
    args = build_parser().parse_args([
        "serve", "--allowed-origins", '["http://a", "http://b"]', "--allowed-methods",
        "GET,POST", "--allow-credentials", "--enable-request-id-headers"])
    assert args.allowed_origins == ["http://a", "http://b"]
    assert args.allowed_methods == ["GET", "POST"]
    assert args.allow_credentials and args.enable_request_id_headers


@pytest.mark.parametrize("body, ok", [
    ('data: {"choices": [{"index": 0, "text": ""}]}\n\ndata: [DONE]\n\n', False),
    ("data: [DONE]\n\n", False),
    ('data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n', True),
    ('data: {"choices": [{"index": 0, "text": "hi"}]}\n\ndata: [DONE]\n\n', True),
])
def test_bench_serve_counts_a_stream_without_text_as_failed(body, ok):
    from fleetllm.benchmarks.serve import _one

    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, text=body, headers={"content-type": "text/event-stream"}))

    async def run():
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await _one(client, CHAT, "hello", 4)

    result = asyncio.run(run())
    assert result.ok is ok, result
    if not ok:
        assert "no text" in result.error
