"""The server app in-process (httpx's ASGI transport): auth, the error shape, dead, wedged
and draining engines (issue: OpenAI-compatible server)."""

from __future__ import annotations

import asyncio
import logging
import re
import threading

import pytest
from serving_helpers import CHAT_TEMPLATE, KV, AppClient, assert_error

from fleetllm.engine.async_engine import AsyncLLMEngine
from fleetllm.entrypoints.openai.api_server import build_app
from fleetllm.entrypoints.openai.gate import ServerState
from fleetllm.errors import WorkerCrashedError

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_gqa"]


@pytest.fixture(scope="module")
def engine(model):
    eng = AsyncLLMEngine.from_engine_args(str(model), kv_cache_memory=KV, max_model_len=256)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def state():
    return ServerState()


@pytest.fixture(scope="module")
def app(engine, state):
    client = AppClient(build_app(engine, ["tiny"], chat_template=CHAT_TEMPLATE, state=state))
    yield client
    client.close()


def ok(app: AppClient) -> None:
    r = app.request("POST", COMPLETIONS, json={"prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert app.request("GET", "/health").status_code == 200


HI = {"prompt": "hi"}
CHAT_HI = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {**HI, "temperature": -0.5}, "temperature"),
    (COMPLETIONS, {**HI, "top_p": 0}, "top_p"),
    (COMPLETIONS, {**HI, "top_p": 1.5}, "top_p"),
    (COMPLETIONS, {**HI, "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {**HI, "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {**HI, "n": 0}, "n"),
    (COMPLETIONS, {**HI, "n": "2"}, "n"),
    (COMPLETIONS, {**HI, "n": True}, "n"),
    (COMPLETIONS, {**HI, "echo": "yes"}, "echo"),
    (COMPLETIONS, {**HI, "seed": 2 ** 70}, "seed"),
    (COMPLETIONS, {**HI, "top_k": 2 ** 40}, "top_k"),
    (COMPLETIONS, {**HI, "stop": [""]}, "stop"),
    (COMPLETIONS, {**HI, "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    (COMPLETIONS, {**HI, "logit_bias": {"5": 1.0}}, "logit_bias"),
    (COMPLETIONS, {**HI, "stop_token_ids": [100000]}, None),
    (COMPLETIONS, {}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": [[]]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, -5]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, 10 ** 6]}, "prompt"),
    (COMPLETIONS, {"prompt": [[1, 2], [3, 99999]]}, "prompt.1"),
    (COMPLETIONS, {"prompt": {"text": "hi"}}, "prompt"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
    (CHAT, {**CHAT_HI, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    (CHAT, {**CHAT_HI, "max_completion_tokens": -1}, "max_completion_tokens"),
    ("/tokenize", {"prompt": "x", "messages": CHAT_HI["messages"]}, "prompt"),
    ("/detokenize", {"tokens": [10 ** 6]}, "tokens"),
])
def test_invalid_fields_are_400_in_openai_shape(app, path, body, param):
    assert_error(app.request("POST", path, json=body), 400, param)


def test_context_length_message_names_the_numbers(app):
    error = assert_error(app.request("POST", COMPLETIONS, json={**HI, "max_tokens": 300}), 400,
                         "max_tokens")
    assert re.match(r"This model's maximum context length is 256 tokens\. However, you "
                    r"requested \d+ tokens \(\d+ in the prompt, 300 in the completion\)",
                    error["message"]), error
    error = assert_error(app.request("POST", CHAT, json={
        "messages": [{"role": "user", "content": "hi " * 300}]}), 400, "messages")
    assert "maximum context length is 256 tokens" in error["message"]


@pytest.mark.parametrize("content, headers", [
    (b'{"prompt": "hi", ', {"content-type": "application/json"}),
    (b'{"prompt": "hi", "temperature": NaN}', {"content-type": "application/json"}),
    (b'{"prompt": "hi", "temperature": Infinity}', {"content-type": "application/json"}),
    (b"[1, 2]", {"content-type": "application/json"}),
    (b'"hello"', {"content-type": "application/json"}),
    (b"\xff\xfe\x00", {"content-type": "application/json"}),
    (b"[" * 100000, {"content-type": "application/json"}),
    (b'{"prompt": "hi"}', {}),
    (b'{"prompt": "hi"}', {"content-type": "text/plain"}),
    (b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}),
])
def test_bodies_that_are_not_json_objects_are_400(app, content, headers):
    assert_error(app.request("POST", COMPLETIONS, content=content, headers=headers), 400)


def test_errors_never_echo_big_inputs(app):
    big = "z" * 1_000_000
    assert_error(app.request("POST", COMPLETIONS, json={"prompt": big, "model": big}), 404)
    assert_error(app.request("POST", COMPLETIONS, json={"prompt": big, "n": big}), 400)
    assert_error(app.request("POST", f"/{big[:50000]}"), 404)
    assert_error(app.request("POST", CHAT, json={"messages": [{"role": big}]}), 400)


def test_unknown_routes_models_and_methods(app):
    assert_error(app.request("GET", "/v2/nothing"), 404)
    assert_error(app.request("GET", COMPLETIONS), 405)
    assert_error(app.request("POST", CHAT, json={**CHAT_HI, "model": "gpt-4"}), 404, "model")
    assert app.request("GET", "/v1/models").json()["data"][0]["id"] == "tiny"
    ok(app)


def test_chat_without_any_template_is_a_clear_400(engine):
    client = AppClient(build_app(engine, ["tiny"]))  # the test tokenizer ships no template
    try:
        error = assert_error(client.request("POST", CHAT, json=CHAT_HI), 400, "messages")
        assert "--chat-template" in error["message"]
    finally:
        client.close()


def test_api_key_guards_all_but_health_and_metrics(engine):
    client = AppClient(build_app(engine, ["tiny"], api_key="s3cret"))
    try:
        assert_error(client.request("GET", "/v1/models"), 401)
        assert_error(client.request("POST", COMPLETIONS, json=HI,
                                    headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(client.request("POST", COMPLETIONS, content=b"{bad",
                                    headers={"content-type": "application/json"}), 401)
        assert client.request("GET", "/health").status_code == 200
        assert client.request("GET", "/metrics").status_code == 200
        r = client.request("POST", COMPLETIONS, json={**HI, "max_tokens": 2},
                           headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200, r.text
    finally:
        client.close()


def test_draining_refuses_new_work_but_keeps_metrics(app, state):
    state.draining = True
    try:
        assert_error(app.request("POST", COMPLETIONS, json=HI), 503)
        assert_error(app.request("GET", "/health"), 503)
        assert app.request("GET", "/metrics").status_code == 200
    finally:
        state.draining = False
    ok(app)


def test_a_wedged_engine_fails_health(app, engine, monkeypatch):
    release = threading.Event()
    real_step = engine.engine.step
    monkeypatch.setattr(engine, "step_timeout_s", 0.3)
    monkeypatch.setattr(engine.engine, "step", lambda: release.wait(30) and real_step())

    async def run():
        request = asyncio.ensure_future(app.client.post(COMPLETIONS, json={**HI,
                                                                          "max_tokens": 2}))
        await asyncio.sleep(0.6)
        health = await app.client.get("/health")
        release.set()
        return health, await request

    health, response = app.run(run())
    assert "no engine step has completed" in assert_error(health, 503)["message"]
    assert response.status_code == 200
    monkeypatch.undo()
    ok(app)


def test_a_dead_engine_is_503_everywhere(model):
    eng = AsyncLLMEngine.from_engine_args(str(model), kv_cache_memory=KV)

    def crash():
        raise WorkerCrashedError("worker rank 1 died (exit code -9)", rank=1, exitcode=-9)

    eng.engine.step = crash
    client = AppClient(build_app(eng, ["tiny"]))
    try:
        error = assert_error(client.request("POST", COMPLETIONS, json=HI), 503)
        assert "worker rank 1 died" in error["message"]
        r = client.request("POST", COMPLETIONS, json={**HI, "stream": True})
        assert_error(r, 503)
        assert_error(client.request("GET", "/health"), 503)
    finally:
        client.close()
        eng.shutdown()


def test_serve_flags_default_to_loopback_and_warn_when_exposed(caplog):
    from fleetllm.cli import build_parser
    from fleetllm.entrypoints.openai.launcher import warn_if_exposed

    args = build_parser().parse_args(["serve", "/some/model", "--tensor-parallel-size", "2"])
    assert (args.host, args.port, args.shutdown_timeout) == ("127.0.0.1", 8000, 10.0)
    assert args.model_tag == "/some/model" and args.tensor_parallel_size == 2
    with caplog.at_level(logging.WARNING, logger="fleetllm.serve"):
        assert warn_if_exposed("0.0.0.0", None)
    assert "without --api-key" in caplog.text
    for host, key in (("127.0.0.1", None), ("::1", None), ("localhost", None),
                      ("0.0.0.0", "k")):
        assert not warn_if_exposed(host, key)
