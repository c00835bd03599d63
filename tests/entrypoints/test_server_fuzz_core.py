"""Issue 70's fuzz pass through the real server: `fleetllm serve` as users run it (the engine
core in its own process, so every request crosses the msgpack wire), sleep mode and runtime
LoRA updating on. Malformed values (ints msgpack cannot carry, non-finite and huge floats,
lone surrogates, 10,000-deep nesting, wrong types, empty and very long strings) go into every
field of every endpoint's body, nested fields included, and into the admin endpoints' query
parameters: never a 5xx, never a hang (a client timeout), and after each one the server still
completes a plain request through the engine core. One server for the file; the cases are
seeded and the whole pass is bounded in time. Besides the values always sent into every field,
`make test` sends 6 more per field (a seeded sample), `make soak` (--soak) every other value.
test_server_fuzz.py fuzzes the app in-process
with hypothesis; test_server_request_bounds.py checks what each 400 says. An embedding
model's server (its own, small) gets the same into /v1/embeddings."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import httpx
import pytest
from conftest import series_size
from serving_helpers import CHAT_TEMPLATE, KV, make_embed_checkpoint, server_env

from fleetllm.entrypoints.openai.local_server import LocalServer
from fleetllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)

SEED = 70
BUDGET_S = 75.0  # per 1,000 cases (a pass has 1,000-3,000); about a third of it on a quiet
# 2-core machine
TIMEOUT_S = 15.0  # a reply slower than this is a hang


class Raw:
    """A value written into the body as this JSON text (NaN, 10,000-deep nesting)."""

    def __init__(self, text: str, name: str):
        self.text, self.name = text, name


DEEP = 10_000
VALUES: dict[str, Any] = {
    "2**64": 2 ** 64, "-2**63-1": -(2 ** 63) - 1, "10**30": 10 ** 30, "2**63": 2 ** 63,
    "-1": -1, "NaN": Raw("NaN", "NaN"), "Infinity": Raw("Infinity", "Infinity"),
    "-Infinity": Raw("-Infinity", "-Infinity"), "1e999": Raw("1e999", "1e999"),
    "1e308": 1e308, "surrogate": "\ud800", "surrogate in text": "a\udfffb",
    "deep list": Raw("[" * DEEP + "]" * DEEP, "deep list"),
    "deep object": Raw('{"a":' * DEEP + "1" + "}" * DEEP, "deep object"),
    "150-deep list": Raw("[" * 150 + "]" * 150, "150-deep list"),
    "object": {}, "list": [], "true": True, "string": "x", "null": None, "[null]": [None],
    "nested 2**64": {"a": [2 ** 64]}, "empty string": "", "long string": "ab" * 150_000,
    "NUL and RTL": "\x00\u202e", "list of ints": [5, 2 ** 64], "float": 0.5,
}
# Always sent into every field (what killed the core's writer thread, or could); of the rest,
# a seeded sample per field (make test) or all of them (make soak).
ALWAYS = ["2**64", "-2**63-1", "surrogate", "deep list", "NaN", "nested 2**64"]
OTHERS = [name for name in VALUES if name not in ALWAYS]

MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}]
# endpoint -> (a valid body, the request model whose every field is fuzzed, nested paths)
ENDPOINTS: dict[str, tuple[dict[str, Any], type, list[tuple]]] = {
    "/v1/completions": ({"model": "tiny", "prompt": "hi", "max_tokens": 2}, CompletionRequest, [
        ("prompt", 0), ("stream_options", "include_usage"), ("response_format", "type"),
        ("response_format", "json_schema", "schema"), ("response_format", "json_schema",
                                                        "schema", "maximum"),
        ("structured_outputs", "json"), ("structured_outputs", "regex"),
        ("structured_outputs", "choice"), ("structured_outputs", "grammar"),
        ("guided_json", "properties"), ("guided_choice", 0), ("stop", 0),
        ("stop_token_ids", 0)]),
    "/v1/chat/completions": ({"model": "tiny", "messages": MESSAGES, "max_tokens": 2},
                             ChatCompletionRequest, [
        ("messages", 0, "content"), ("messages", 0, "role"), ("messages", 0, "name"),
        ("messages", 0, "tool_calls"), ("messages", 0, "content", 0, "text"),
        ("messages", 1), ("tools", 0, "function", "parameters"),
        ("tools", 0, "function", "parameters", "properties", "a", "maximum"),
        ("tools", 0, "function", "name"), ("tool_choice", "function", "name"),
        ("response_format", "json_schema", "schema")]),
    "/v1/embeddings": ({"model": "tiny", "input": "hi"}, EmbeddingRequest, [("input", 0)]),
    "/tokenize": ({"model": "tiny", "prompt": "hi"}, TokenizeRequest,
                  [("messages", 0, "content")]),
    "/detokenize": ({"model": "tiny", "tokens": [5, 6]}, DetokenizeRequest, [("tokens", 0)]),
    "/v1/load_lora_adapter": ({"lora_name": "x", "lora_path": "/nonexistent"},
                              LoadLoRAAdapterRequest, []),
    "/v1/unload_lora_adapter": ({"lora_name": "x"}, UnloadLoRAAdapterRequest, []),
}
QUERY_ENDPOINTS = [("POST", "/sleep", "level"), ("POST", "/wake_up", "tags"),
                   ("GET", "/v1/models", "x"), ("GET", "/is_sleeping", "x")]
# What a nested path needs around it to be read at all (a chat message with parts, ...).
SHAPES: dict[tuple, dict[str, Any]] = {
    ("messages", 0, "content", 0, "text"): {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}]},
    ("tools", 0, "function", "parameters"): {"tools": TOOLS, "tool_choice": "required"},
    ("tools", 0, "function", "parameters", "properties", "a", "maximum"): {
        "tools": TOOLS, "tool_choice": "required"},
    ("tools", 0, "function", "name"): {"tools": TOOLS},
    ("tool_choice", "function", "name"): {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "f"}}},
    ("response_format", "json_schema", "schema"): {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    ("response_format", "json_schema", "schema", "maximum"): {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
    ("guided_json", "properties"): {"guided_json": {"type": "object"}},
    ("structured_outputs", "json"): {"structured_outputs": {}},
    ("prompt", 0): {"prompt": ["hi", "there"]},
    ("input", 0): {"input": ["hi"]},
    ("input", 0, 0): {"input": [[5, 6]]},
    ("messages", 1): {"messages": [*MESSAGES, *MESSAGES]},
}


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    template = tmp_path_factory.mktemp("fuzz") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    srv = LocalServer([str(tiny_models["llama_gqa"]), "--served-model-name", "tiny",
                       "--chat-template", str(template), "--kv-cache-memory", str(KV),
                       "--max-model-len", "64", "--enable-sleep-mode", "--enable-lora",
                       "--max-lora-rank", "8", "--allow-runtime-lora-updating"],
                      env=server_env())
    try:
        yield srv
    finally:
        srv.stop(timeout=30)


def body_text(base: dict[str, Any], path: tuple, value: Any) -> str:
    """`base` with `value` at `path` (containers made on the way), as JSON text."""
    body = json.loads(json.dumps(base))
    node: Any = body
    for i, key in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(node, list):
            while len(node) <= key:
                node.append({} if not isinstance(nxt, int) else [])
            if not isinstance(node[key], dict | list):
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
        else:
            if not isinstance(node.get(key), dict | list):
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
    last = path[-1]
    marker = "@@RAW@@"
    put = marker if isinstance(value, Raw) else value
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = put
    text = json.dumps(body)  # a lone surrogate is written as its \\ud800 escape
    return text.replace(json.dumps(marker), value.text) if isinstance(value, Raw) else text


def cases(rng: random.Random, endpoints: dict, query_endpoints: list, sampled: int
          ) -> list[tuple[str, str, str, tuple, str]]:
    """(method, path, body or query, field path, value name), seeded: ALWAYS and `sampled` of
    the other values into each field."""
    out = []
    for endpoint, (base, model, nested) in endpoints.items():
        fields = [(f.alias or name,) for name, f in model.model_fields.items()]
        for field in [*fields, *nested]:
            shaped = {**base, **SHAPES.get(field, {})}
            for name in [*ALWAYS, *rng.sample(OTHERS, sampled)]:
                out.append(("POST", endpoint, body_text(shaped, field, VALUES[name]), field,
                            name))
    for method, endpoint, param in query_endpoints:
        for text in ["18446744073709551616", "-9223372036854775809", "nan", "inf", "1e308",
                     "%ED%A0%80", "%00", "x" * 5000, "", "3", "0", "-1", "weights&tags=x"]:
            out.append((method, endpoint, f"{param}={text}", (param,), text[:20]))
    rng.shuffle(out)
    return out


def fuzz(server: LocalServer, plan: list, plain: tuple[str, dict[str, Any]]) -> None:
    """Send each case, then `plain` (it must succeed, through the engine core); fail on a
    hang at once, and on 5xx answers at the end, listing them."""
    failures: list[str] = []
    budget = BUDGET_S * max(1.0, len(plan) / 1000)
    started = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as client:
        for done, (method, endpoint, payload, field, name) in enumerate(plan):
            assert time.monotonic() - started < budget, \
                f"{done} of {len(plan)} cases in {budget:.0f} s"
            what = f"{method} {endpoint} {'.'.join(map(str, field))} = {name}"
            try:
                if method == "GET" or endpoint in ("/sleep", "/wake_up"):
                    r = client.request(method, f"{endpoint}?{payload}")
                else:
                    r = client.post(endpoint, content=payload.encode(),
                                    headers={"content-type": "application/json"})
            except httpx.TimeoutException:
                pytest.fail(f"{what}: no answer in {TIMEOUT_S} s\n{server.log()[-3000:]}")
            if r.status_code >= 500:
                failures.append(f"{what}: {r.status_code} {r.text[:200]}")
            if endpoint == "/sleep" and r.status_code == 200:  # a valid level: wake it up
                assert client.post("/wake_up").status_code == 200
            try:
                ok = client.post(plain[0], json=plain[1])
            except httpx.TimeoutException:
                pytest.fail(f"after {what}: a plain request had no answer in {TIMEOUT_S} s\n"
                            f"{server.log()[-3000:]}")
            assert ok.status_code == 200, (what, ok.status_code, ok.text[:300],
                                           server.log()[-3000:])
        assert client.get("/health").status_code == 200
    assert not failures, "\n".join(failures[:30])


def sampled(soak: bool) -> int:
    return series_size(soak, 6, len(OTHERS))


@pytest.mark.soak
def test_malformed_values_in_every_field_never_5xx_or_hang_and_the_core_serves_on(server, soak):
    plan = cases(random.Random(SEED), ENDPOINTS, QUERY_ENDPOINTS, sampled(soak))
    assert len(plan) > 1000, len(plan)
    fuzz(server, plan, ("/v1/completions", {"model": "tiny", "prompt": [5, 6],
                                            "max_tokens": 1, "ignore_eos": True}))


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory):
    model = make_embed_checkpoint(tmp_path_factory.mktemp("embed") / "model")
    srv = LocalServer([str(model), "--served-model-name", "tiny", "--kv-cache-memory",
                       str(KV), "--max-model-len", "64"], env=server_env())
    try:
        yield srv
    finally:
        srv.stop(timeout=30)


EMBED_ENDPOINTS = {
    "/v1/embeddings": ({"model": "tiny", "input": "hi"}, EmbeddingRequest, [
        ("input", 0), ("input", 0, 0)]),
    "/v1/completions": ENDPOINTS["/v1/completions"],  # the other task: a 400 naming it
}


@pytest.mark.soak
def test_malformed_values_into_an_embedding_server_never_5xx_or_hang(embed_server, soak):
    plan = cases(random.Random(SEED), EMBED_ENDPOINTS, [], sampled(soak))
    fuzz(embed_server, plan, ("/v1/embeddings", {"model": "tiny", "input": [5, 6]}))


def test_replies_on_a_kept_alive_connection_are_not_held_by_nagle(server):
    """Each reply after the first on one connection waited ~40 ms (Nagle against the
    client's delayed ACK: the server's socket lacked TCP_NODELAY); now it is immediate."""
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as client:
        took = []
        for _ in range(21):
            started = time.perf_counter()
            assert client.get("/version").status_code == 200
            took.append(time.perf_counter() - started)
    took.sort()
    assert took[10] < 0.03, took  # the median; a delayed ACK is 40 ms at least


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi", "guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2 ** 64]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [512]}, "stop_token_ids"),
])
def test_the_engine_core_s_400s_name_their_param(server, path, body, param):
    """A refusal from the engine core (across its wire: a class name and a message) names
    the request's field, as one from the API process does."""
    r = httpx.post(f"{server.url}{path}", json={"model": "tiny", "max_tokens": 2, **body},
                   timeout=TIMEOUT_S)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
