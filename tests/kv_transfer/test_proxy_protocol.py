"""`fleetllm proxy`'s protocol against recording stand-ins for the instances (in-process
uvicorn apps on loopback): what each leg is sent (vLLM's toy-proxy fields, one X-Request-Id),
round robin, an unreachable or silent instance -> 502/504 naming it, a stream that breaks ->
an in-band error, and a client that leaves -> the decode leg's connection closed (issue 74)."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from serving_helpers import server_env, serving

from fleetllm.entrypoints.openai.local_server import LocalServer

TIMEOUT = httpx.Timeout(30.0)
PARAMS_FROM = "remote_engine_id"  # the stand-in prefill names itself there


class StandIn:
    """A fake `fleetllm serve` on a free loopback port: records every request (path, body,
    X-Request-Id); a prefill answer carries kv_transfer_params naming it; `delay` stalls
    answers; a stream sends `chunks` events then, with `break_stream`, dies mid-way."""

    def __init__(self, name: str):
        self.name = name
        self.seen: list[dict[str, Any]] = []
        self.delay = 0.0
        self.break_stream = False
        self.closed = threading.Event()  # a stream whose client went away
        app = FastAPI()
        app.post("/v1/completions")(self._answer)
        app.post("/v1/chat/completions")(self._answer)
        app.get("/health")(lambda: JSONResponse({}))
        app.get("/v1/models")(lambda: JSONResponse({"data": [{"id": name}]}))
        sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)

    async def _answer(self, raw: Request):
        body = await raw.json()
        self.seen.append({"path": raw.url.path, "body": body,
                          "request_id": raw.headers.get("x-request-id"),
                          "auth": raw.headers.get("authorization")})
        await asyncio.sleep(self.delay)
        if body.get("stream"):
            return StreamingResponse(self._events(raw), media_type="text/event-stream")
        if body.get("refuse"):
            return JSONResponse({"error": {"message": f"{self.name} refuses"}}, 400)
        params = {"do_remote_prefill": True, PARAMS_FROM: self.name, "remote_block_ids": [1]}
        return JSONResponse({"choices": [{"text": self.name}], "kv_transfer_params": params}
                            if body.get("kv_transfer_params", {}).get("do_remote_decode")
                            else {"choices": [{"text": self.name}]})

    async def _events(self, raw: Request):
        try:
            for i in range(50 if not self.break_stream else 2):
                yield f"data: {json.dumps({'i': i})}\n\n"
                await asyncio.sleep(0.05)
            if self.break_stream:
                raise RuntimeError("the instance died mid-stream")
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.closed.set()
            raise

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def stand_ins():
    made = {name: StandIn(name) for name in ("p1", "p2", "d1", "d2")}
    yield made
    for s in made.values():
        s.stop()


def run_proxy(prefill: list[StandIn | str], decode: list[StandIn | str], *extra: str
              ) -> LocalServer:
    urls = [[s if isinstance(s, str) else s.url for s in group] for group in (prefill, decode)]
    cmd = [sys.executable, "-m", "fleetllm.cli", "proxy", "--port", "0", "--prefill",
           *urls[0], "--decode", *urls[1], *extra]
    return LocalServer([], env=server_env(), command=cmd, startup_timeout=60,
                       ready_prefix="fleetllm proxy: listening on ")


def test_the_legs_round_robin_with_one_request_id(stand_ins):
    p1, p2, d1, d2 = (stand_ins[n] for n in ("p1", "p2", "d1", "d2"))
    with serving(run_proxy([p1, p2], [d1, d2])) as srv:
        answers = [httpx.post(f"{srv.url}/v1/completions", timeout=TIMEOUT,
                              json={"prompt": "hi", "max_tokens": 9, "min_tokens": 3,
                                    "stream_options": {"include_usage": True}})
                   for _ in range(4)]
        chat = httpx.post(f"{srv.url}/v1/chat/completions", timeout=TIMEOUT,
                          headers={"X-Request-Id": "mine", "Authorization": "Bearer k"},
                          json={"messages": [], "max_completion_tokens": 5})
        models = httpx.get(f"{srv.url}/v1/models", timeout=TIMEOUT)
        health = httpx.get(f"{srv.url}/health", timeout=TIMEOUT)
        refused = httpx.post(f"{srv.url}/v1/completions", json={"refuse": True},
                             timeout=TIMEOUT)
        too_big = httpx.post(f"{srv.url}/v1/completions", content=b" " * (17 << 20),
                             timeout=TIMEOUT)
        not_json = httpx.post(f"{srv.url}/v1/completions", content=b"{", timeout=TIMEOUT)
    assert models.json()["data"][0]["id"] in ("d1", "d2")
    assert health.status_code == 200
    assert health.json() == {"prefill": {p1.url: "ok", p2.url: "ok"},
                             "decode": {d1.url: "ok", d2.url: "ok"}}
    # a prefill instance's own error is the client's, as it came; no decode leg follows
    assert refused.status_code == 400 and refused.json()["error"]["message"] == "p2 refuses"
    assert [too_big.status_code, not_json.status_code] == [413, 400]
    assert [a.json()["choices"][0]["text"] for a in answers] == ["d1", "d2", "d1", "d2"]
    assert [len(s.seen) for s in (p1, p2, d1, d2)] == [3, 3, 3, 2]
    prefill = p1.seen[0]["body"]
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert "min_tokens" not in prefill and "stream_options" not in prefill
    assert prefill["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
    decode = d1.seen[0]["body"]
    assert decode["max_tokens"] == 9 and decode["min_tokens"] == 3
    assert decode["kv_transfer_params"][PARAMS_FROM] == "p1"
    assert d2.seen[0]["body"]["kv_transfer_params"][PARAMS_FROM] == "p2"
    ids = [s.seen[0]["request_id"] for s in (p1, d1)]
    assert ids[0] and ids[0] == ids[1] == answers[0].headers["x-request-id"]
    assert p1.seen[2]["request_id"] == d1.seen[-1]["request_id"] == "mine"
    assert p1.seen[2]["body"]["max_completion_tokens"] == 1
    assert d1.seen[-1]["body"]["max_completion_tokens"] == 5
    assert chat.headers["x-request-id"] == "mine"
    # an instance's --api-key: the client's key goes with both legs
    assert p1.seen[2]["auth"] == d1.seen[-1]["auth"] == "Bearer k"


def test_unreachable_and_silent_instances_are_clear_errors(stand_ins):
    p1, d1 = stand_ins["p1"], stand_ins["d1"]
    with socket.create_server(("127.0.0.1", 0)) as s:
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed when the block ends
    with serving(run_proxy([p1], [dead, d1], "--timeout", "1")) as srv:
        post = lambda: httpx.post(f"{srv.url}/v1/completions",  # noqa: E731
                                  json={"prompt": "x"}, timeout=TIMEOUT)
        r = post()
        assert r.status_code == 502 and dead in r.json()["error"]["message"]
        assert post().json()["choices"][0]["text"] == "d1"  # the next one is served
        p1.delay = 3
        started = time.monotonic()
        r = post()
        assert r.status_code == 504 and "prefill" in r.json()["error"]["message"]
        assert time.monotonic() - started < 2.5
        p1.delay = 0


def test_a_broken_stream_ends_with_an_error_event(stand_ins):
    stand_ins["d1"].break_stream = True
    with serving(run_proxy([stand_ins["p1"]], [stand_ins["d1"]])) as srv:
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=TIMEOUT,
                          json={"prompt": "x", "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200
    assert [json.loads(x[6:]) for x in lines[:2]] == [{"i": 0}, {"i": 1}]
    assert json.loads(lines[-1][6:])["error"]["code"] == 502


def test_a_client_that_leaves_closes_the_decode_leg(stand_ins):
    d1 = stand_ins["d1"]
    with serving(run_proxy([stand_ins["p1"]], [d1])) as srv:
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=TIMEOUT,
                          json={"prompt": "x", "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # and hang up after the first event
        assert d1.closed.wait(10), "the decode leg's stream was not closed"
        d1.delay = 30  # a plain request: the client leaves during the decode leg
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}, timeout=1.0)
        assert httpx.get(f"{srv.url}/health", timeout=TIMEOUT).status_code == 200
