"""SIGTERM drains `fleetllm serve` on the mp backend: in-flight requests finish or end with a
terminal error event, the process exits 0, no worker process is left (issue: OpenAI
server)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
from serving_helpers import KV, alive, assert_error, engine_workers, server_env

from fleetllm.entrypoints.openai.local_server import LocalServer

SHUTDOWN_TIMEOUT = 3.0


def test_sigterm_drains_a_tp2_server_and_exits_0_without_workers(tiny_models):
    model = tiny_models["llama_gqa"]
    # 20 ms per step on every rank: 20 tokens take ~0.5 s, 400 take far longer than the drain.
    srv = LocalServer([str(model), "--kv-cache-memory", str(KV), "--tensor-parallel-size", "2",
                       "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
                       "--worker-cls", "serving_helpers.SlowWorker"],
                      env=server_env(FLEETLLM_TEST_STEP_DELAY="0.02"))
    try:
        workers = engine_workers(srv.pid)
        assert len(workers) >= 2, workers

        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                started = [asyncio.Event(), asyncio.Event()]

                async def stream(i: int, max_tokens: int) -> list[dict | str]:
                    body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True,
                            "stream": True}
                    events: list[dict | str] = []
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                data = line[6:]
                                events.append(data if data == "[DONE]" else json.loads(data))
                                started[i].set()
                    return events

                tasks = [asyncio.create_task(stream(0, 20)), asyncio.create_task(stream(1, 400))]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                os.kill(srv.pid, signal.SIGTERM)
                sent = time.monotonic()
                await asyncio.sleep(0.3)
                late = await client.post("/v1/completions", json={"prompt": "hi"})
                health = await client.get("/health")
                short, long = await asyncio.gather(*tasks)
                return sent, late, health, short, long

        sent, late, health, short, long = asyncio.run(run())
        assert "shutting down" in assert_error(late, 503)["message"]
        assert_error(health, 503)
        # The short request finished normally, with every token.
        assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
        assert all("error" not in e for e in short[:-1])
        # The long one outlived the drain: it ends with an error event, then [DONE].
        assert long[-1] == "[DONE]" and "shutting down" in long[-2]["error"]["message"]
        assert long[-2]["error"]["code"] == 503
        assert srv.proc.wait(SHUTDOWN_TIMEOUT + 30) == 0, srv.log()[-3000:]
        assert time.monotonic() - sent < SHUTDOWN_TIMEOUT + 20
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in workers if alive(pid)], srv.log()[-3000:]
    finally:
        srv.kill()
