"""Issue 70 ("Hardening III"), the API process's side of defects 2 and 6 and the engine-side
400s' `param`, in-process: a value nothing past the API could carry (an id past the
vocabulary or 2**64, an int msgpack cannot hold anywhere in a body, a lone surrogate, a
non-finite float, deep nesting) is a 400 naming its field before anything reaches the
engine; a request's prompts x n are capped (--max-prompts-per-request); a text that cannot
fit max_model_len is refused before it is tokenized; a client that leaves while its prompts
are prepared stops the preparation. The same bodies through the engine-core-process server
are in test_server_fuzz_core.py."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from serving_helpers import CHAT_TEMPLATE, KV, AppClient, assert_error

from fleetllm.engine.async_engine import AsyncLLMEngine
from fleetllm.entrypoints.openai.api_server import build_app
from fleetllm.entrypoints.openai.cli_args import add_serve_args
from fleetllm.entrypoints.openai.errors import api_error_from
from fleetllm.errors import InvalidRequestError, LoRAAdapterError

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = {"prompt": "hi", "max_tokens": 2}
MESSAGES = [{"role": "user", "content": "hi"}]
VOCAB = 512  # the tiny checkpoints'
HUGE = 18446744073709551616  # 2**64: one past what msgpack carries


@pytest.fixture(scope="module")
def engine(tiny_models):
    eng = AsyncLLMEngine.from_engine_args(str(tiny_models["llama_gqa"]), kv_cache_memory=KV,
                                          max_model_len=256)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def app(engine):
    client = AppClient(build_app(engine, ["tiny"], chat_template=CHAT_TEMPLATE,
                                 max_prompts_per_request=6))
    yield client
    client.close()


def served(app: AppClient) -> None:
    r = app.request("POST", COMPLETIONS, json={"prompt": [5, 6], "max_tokens": 2})
    assert r.status_code == 200, r.text


def raw_json(app: AppClient, path: str, text: str):
    """A body as JSON text (json= cannot send a lone surrogate or NaN as the client wrote
    it)."""
    return app.request("POST", path, content=text.encode(),
                       headers={"content-type": "application/json"})


# ------------------------------------------------------- defect 2: ids below the vocabulary


@pytest.mark.parametrize("ids, param", [
    ([HUGE], "stop_token_ids"), ([2 ** 63], "stop_token_ids"), ([VOCAB], "stop_token_ids"),
    ([5, 10 ** 30], "stop_token_ids"), ([-1], "stop_token_ids.0"),
    ([-(2 ** 63) - 1], "stop_token_ids"),
])
@pytest.mark.parametrize("path, base", [(COMPLETIONS, HI), (CHAT, {"messages": MESSAGES})])
def test_stop_token_ids_outside_the_vocabulary_are_a_400_naming_them(app, ids, param, path,
                                                                      base):
    assert_error(app.request("POST", path, json={**base, "stop_token_ids": ids}), 400, param)
    served(app)


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"prompt": [5, HUGE]}, "prompt"),
    (COMPLETIONS, {"prompt": [5, VOCAB]}, "prompt"),
    (COMPLETIONS, {"prompt": [[5], [2 ** 63]]}, "prompt.1"),
    ("/detokenize", {"tokens": [HUGE]}, "tokens"),
    ("/detokenize", {"tokens": [VOCAB]}, "tokens"),
])
def test_prompt_ids_outside_the_vocabulary_are_a_400_naming_them(app, path, body, param):
    assert_error(app.request("POST", path, json=body), 400, param)


BIG_INTS = [HUGE, -(2 ** 63) - 1, 10 ** 30]


@pytest.mark.parametrize("value", BIG_INTS)
@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, lambda v: {**HI, "guided_json": {"type": "integer", "maximum": v}},
     "guided_json.maximum"),
    (COMPLETIONS, lambda v: {**HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": v}}}},
     "response_format.json_schema.schema.minimum"),
    (COMPLETIONS, lambda v: {**HI, "structured_outputs": {"json": {"enum": [1, v]}}},
     "structured_outputs.json.enum"),
    (CHAT, lambda v: {"messages": MESSAGES, "tool_choice": "required", "tools": [{
        "type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer", "maximum": v}}}}}]},
     "tools.0.function.parameters.properties.a.maximum"),
    (CHAT, lambda v: {"messages": MESSAGES, "seed": v}, "seed"),
    (COMPLETIONS, lambda v: {**HI, "user": "u", "metadata": {"k": v}}, "metadata.k"),
])
def test_an_int_msgpack_cannot_carry_anywhere_is_a_400_naming_its_path(app, value, path,
                                                                      body, param):
    assert_error(app.request("POST", path, json=body(value)), 400, param)
    served(app)


SURROGATE = '"a\\ud800b"'  # valid JSON text; no UTF-8 encoder takes the string


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, '{"prompt": %s}', "prompt"),
    (COMPLETIONS, '{"prompt": ["ok", %s]}', "prompt.1"),
    (CHAT, '{"messages": [{"role": "user", "content": %s}]}', "messages.0.content"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}',
     "messages.0.content.0.text"),
    (COMPLETIONS, '{"prompt": "hi", "guided_regex": %s}', "guided_regex"),
    (COMPLETIONS, '{"prompt": "hi", "guided_choice": ["a", %s]}', "guided_choice.1"),
    (COMPLETIONS, '{"prompt": "hi", "guided_grammar": %s}', "guided_grammar"),
    (COMPLETIONS, '{"prompt": "hi", "guided_json": {"enum": [%s]}}', "guided_json.enum.0"),
    (COMPLETIONS, '{"prompt": "hi", "guided_json": {%s: 1}}', "guided_json.a\\ud800b"),
    (COMPLETIONS, '{"prompt": "hi", "stop": [%s]}', "stop.0"),
    ("/tokenize", '{"prompt": %s}', "prompt"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(app, path, body, param):
    error = assert_error(raw_json(app, path, body % SURROGATE), 400, param)
    assert "surrogate" in error["message"]
    served(app)


@pytest.mark.parametrize("text, param", [
    ('{"prompt": "hi", "guided_json": {"maximum": NaN}}', "guided_json.maximum"),
    ('{"prompt": "hi", "guided_json": {"maximum": 1e999}}', "guided_json.maximum"),
    ('{"prompt": "hi", "guided_json": {"minimum": -Infinity}}', "guided_json.minimum"),
    ('{"prompt": "hi", "temperature": NaN}', "temperature"),
])
def test_a_non_finite_number_anywhere_is_a_400(app, text, param):
    assert_error(raw_json(app, COMPLETIONS, text), 400, param)


@pytest.mark.parametrize("depth", [150, 900, 10_000])
def test_deep_nesting_anywhere_is_a_400(app, depth):
    for inner in ("[" * depth + "]" * depth, '{"a": ' * depth + "1" + "}" * depth):
        r = raw_json(app, COMPLETIONS, '{"prompt": "hi", "guided_json": ' + inner + '}')
        assert_error(r, 400)
    served(app)


# ------------------------------------------------------------ the engine's 400s name a param


def test_invalid_request_errors_carry_their_param_across_a_message_only_boundary():
    assert InvalidRequestError("stop_token_ids: ids [600] are outside").param == \
        "stop_token_ids"
    assert InvalidRequestError("x", param="n").param == "n"
    assert InvalidRequestError("the engine refused it: why").param is None
    # the engine-core wire rebuilds an error from its class name and message only
    rebuilt = InvalidRequestError(InvalidRequestError("prompt: 300 tokens").args[0])
    assert rebuilt.param == "prompt"
    assert LoRAAdapterError("model: no such adapter").param == "model"
    error = api_error_from(InvalidRequestError("n: 2 samples need 10 blocks"))
    assert (error.status, error.param) == (400, "n")


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {**HI, "guided_regex": "(unclosed"}, "guided_regex"),
    (COMPLETIONS, {**HI, "guided_json": {"type": "nonsense"}}, "guided_json"),
    (COMPLETIONS, {**HI, "structured_outputs": {"grammar": "root ::= ("}},
     "structured_outputs"),
    (CHAT, {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
])
def test_a_constraint_the_engine_refuses_is_a_400_naming_the_field(app, path, body, param):
    assert_error(app.request("POST", path, json=body), 400, param)


def test_an_engine_side_vocabulary_check_names_stop_token_ids(engine):
    """The API checks first; the engine's own check (LLM, a direct engine client) names the
    field too."""
    from fleetllm.sampling_params import SamplingParams

    async def add():
        await engine.add_request("bad", {"prompt_token_ids": [5]},
                                 SamplingParams(stop_token_ids=[VOCAB]))

    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(add())
    assert info.value.param == "stop_token_ids"
    assert api_error_from(info.value).param == "stop_token_ids"


# ------------------------------------------------------- defect 6: bounded work per request


def test_prompts_times_n_are_capped_before_any_is_tokenized(app, engine, monkeypatch):
    calls = []
    tokenize = engine.tokenize

    async def counted(*args, **kwargs):
        calls.append(1)
        return await tokenize(*args, **kwargs)

    monkeypatch.setattr(engine, "tokenize", counted)
    for body in ({"prompt": ["a"] * 7}, {"prompt": ["a", "b"], "n": 4},
                 {"prompt": [[5]] * 7}):
        error = assert_error(app.request("POST", COMPLETIONS, json={**body, "max_tokens": 1}),
                             400, "prompt")
        assert "--max-prompts-per-request=6" in error["message"]
    assert calls == []
    assert_error(app.request("POST", "/v1/embeddings", json={"input": ["a"] * 7}), 400)
    for path, body in ((COMPLETIONS, {"prompt": "a", "n": 7}),
                       (CHAT, {"messages": MESSAGES, "n": 7})):
        error = assert_error(app.request("POST", path, json={**body, "max_tokens": 1}), 400,
                             "n")
        assert "--max-prompts-per-request=6" in error["message"]
    r = app.request("POST", COMPLETIONS, json={"prompt": ["a", "b", "c"], "n": 2,
                                               "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 6, r.text


def test_the_flag_s_default_and_parsing():
    import argparse

    parser = add_serve_args(argparse.ArgumentParser())
    assert parser.parse_args([]).max_prompts_per_request == 4096
    assert parser.parse_args(["--max-prompts-per-request", "10"]).max_prompts_per_request == 10


def test_a_text_past_what_max_model_len_tokens_can_spell_is_refused_untokenized(
        app, engine, monkeypatch):
    async def never(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(engine, "tokenize", never)
    monkeypatch.setattr(engine, "run_in_tokenizer_thread", never)
    text = "hello " * 200_000  # 1.2 MB; 256 tokens of at most ~10 characters cannot hold it
    for path, body, param in [
            (COMPLETIONS, {"prompt": text}, "prompt"),
            (COMPLETIONS, {"prompt": ["hi", text]}, "prompt.1"),
            (CHAT, {"messages": [{"role": "user", "content": text}]}, "messages.0.content"),
            ("/tokenize", {"prompt": text}, "prompt")]:
        started = time.monotonic()
        error = assert_error(app.request("POST", path, json=body), 400, param)
        assert "max_model_len=256" in error["message"] and time.monotonic() - started < 5


def test_a_client_that_leaves_while_its_prompts_are_prepared_stops_them(engine, monkeypatch):
    """200 prompts, each tokenized slowly; the client hangs up after 0.3 s: tokenizing stops
    there, and nothing it added stays in the engine."""
    app = build_app(engine, ["tiny"])
    calls = []
    tokenize = engine.tokenize

    async def slow(*args, **kwargs):
        calls.append(1)
        await asyncio.sleep(0.02)
        return await tokenize(*args, **kwargs)

    monkeypatch.setattr(engine, "tokenize", slow)
    body = json.dumps({"prompt": ["hello"] * 200, "max_tokens": 50}).encode()
    sent: list[dict] = []

    async def run() -> None:
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(0.3)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": COMPLETIONS, "raw_path": b"",
                 "query_string": b"", "root_path": "", "server": ("app", 80),
                 "client": ("test", 1), "headers": [(b"content-type", b"application/json")]}
        await asyncio.wait_for(app(scope, receive, send), 10)
        count = len(calls)
        await asyncio.sleep(0.3)
        assert len(calls) == count  # nothing tokenized after the answer

    asyncio.run(run())
    assert 0 < len(calls) < 100, len(calls)
    assert sent[0]["status"] == 499
    deadline = time.monotonic() + 5
    while engine.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests left in the engine"
        time.sleep(0.05)


def test_the_listening_socket_sets_tcp_nodelay_for_kept_alive_connections():
    """Found by the fuzz pass: with proto 0 asyncio skipped TCP_NODELAY, and each reply after
    the first on a kept-alive connection waited ~40 ms for the client's delayed ACK (the
    latency test against a real server is in test_server_fuzz_core.py)."""
    import socket

    from fleetllm.entrypoints.openai.launcher import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        sock.listen()
        client = socket.create_connection(sock.getsockname()[:2])
        accepted, _ = sock.accept()
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        accepted.close()
        client.close()
    finally:
        sock.close()


def test_an_embedding_input_truncated_to_its_end_is_tokenized_from_its_end_alike(
        tmp_path_factory):
    """With truncate_prompt_tokens a text past what max_model_len tokens can spell is served
    (its last tokens are what counts), tokenizing only its end: the same ids, the same
    vector as the whole text's last tokens."""
    from serving_helpers import make_embed_checkpoint
    from transformers import AutoTokenizer

    model = make_embed_checkpoint(tmp_path_factory.mktemp("embed") / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    eng = AsyncLLMEngine.from_engine_args(str(model), task="embed", kv_cache_memory=KV,
                                          max_model_len=64)
    client = AppClient(build_app(eng, ["e"]))
    try:
        text = "the quick brown fox jumps over the lazy dog, said she. " * 400  # 22,000 chars
        ids = tokenizer.encode(text)[-8:]
        got = client.request("POST", "/v1/embeddings", json={
            "input": text, "truncate_prompt_tokens": 8})
        assert got.status_code == 200, got.text
        assert got.json()["usage"]["prompt_tokens"] == 8
        want = client.request("POST", "/v1/embeddings", json={"input": ids})
        assert got.json()["data"][0]["embedding"] == want.json()["data"][0]["embedding"]
        error = assert_error(client.request("POST", "/v1/embeddings", json={"input": text}),
                             400, "input")
        assert "max_model_len=64" in error["message"]
    finally:
        client.close()
        eng.shutdown()
