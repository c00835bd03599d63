"""Fault tolerance through the server: a worker SIGKILLed under 16 concurrent streams is
replaced and every stream completes with the undisturbed text; past max_worker_restarts
streams end with a terminal error event and the server exits 1. Sleep mode endpoints."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest
from serving_helpers import KV, AppClient, engine_workers, metric, metric_values, server_env

from fleetllm.engine.async_engine import AsyncLLMEngine
from fleetllm.entrypoints.openai.api_server import build_app
from fleetllm.entrypoints.openai.local_server import LocalServer

pytestmark = pytest.mark.timeout(300)


def start_tp2(model, *extra: str) -> LocalServer:
    # 10 ms per step: the streams are still running when the worker is killed.
    return LocalServer([str(model), "--kv-cache-memory", str(KV), "--tensor-parallel-size",
                        "2", "--worker-cls", "serving_helpers.SlowWorker", *extra],
                       env=server_env(FLEETLLM_TEST_STEP_DELAY="0.01"))


async def streams(url: str, count: int, kill_pid: int | None) -> list[list]:
    """`count` greedy and seeded streams; SIGKILL `kill_pid` once every stream has output."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        started = [asyncio.Event() for _ in range(count)]

        async def one(i: int) -> list:
            body = {"prompt": [5 + i, 6, 7, 8], "max_tokens": 40, "ignore_eos": True,
                    "stream": True, "temperature": 0 if i % 2 else 1.0, "seed": i}
            events = []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        started[i].set()
            return events

        tasks = [asyncio.create_task(one(i)) for i in range(count)]
        if kill_pid is not None:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            os.kill(kill_pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)


def text_of(events: list) -> str:
    return "".join(e["choices"][0]["text"] for e in events if "choices" in e)


def test_a_killed_worker_is_replaced_and_every_stream_completes(tiny_models):
    srv = start_tp2(tiny_models["llama_gqa"])
    try:
        undisturbed = asyncio.run(streams(srv.url, 16, None))
        workers = engine_workers(srv.pid)
        assert len(workers) >= 2
        disturbed = asyncio.run(streams(srv.url, 16, workers[-1]))
        for before, after in zip(undisturbed, disturbed, strict=True):
            assert all("error" not in e for e in after)  # no client sees an error
            assert text_of(after) == text_of(before) and text_of(after)
        values = metric_values(httpx.get(srv.url + "/metrics").text)
        assert metric(values, "fleetllm:worker_restarts_total") == 1
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.kill()


@pytest.mark.parametrize("frontend", ["core-process", "in-process"])
def test_past_the_restart_limit_streams_end_with_an_error_and_the_server_exits_1(tiny_models,
                                                                                 frontend):
    """The engine is dead for good: streams end with an error event, and the server exits
    non-zero for a supervisor to restart it (vLLM exits on EngineDeadError too), rather
    than answer 503 for ever; with the engine in the API process too."""
    extra = ["--disable-frontend-multiprocessing"] if frontend == "in-process" else []
    srv = start_tp2(tiny_models["llama_gqa"], "--max-worker-restarts", "0", *extra)
    try:
        workers = engine_workers(srv.pid)
        outcome = asyncio.run(streams(srv.url, 4, workers[-1]))
        for events in outcome:
            assert "error" in events[-1], events[-1]  # a terminal error event
            assert "WorkerCrashedError" in events[-1]["error"]["message"] or \
                "died" in events[-1]["error"]["message"]
        assert srv.proc.wait(30) == 1
    finally:
        srv.kill()


def test_sleep_mode_endpoints(tiny_models):
    engine = AsyncLLMEngine.from_engine_args(str(tiny_models["llama_gqa"]), kv_cache_memory=KV)
    client = AppClient(build_app(engine, ["tiny"], enable_sleep_mode=True))
    plain = AppClient(build_app(engine, ["tiny"]))
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}
        before = client.request("POST", "/v1/completions", json=body).json()
        assert plain.request("POST", "/sleep").status_code == 404  # only when enabled
        assert client.request("GET", "/is_sleeping").json() == {"is_sleeping": False}
        for _ in range(2):  # sleeping twice is harmless
            assert client.request("POST", "/sleep?level=2").status_code == 200
        assert client.request("GET", "/is_sleeping").json() == {"is_sleeping": True}
        asleep = client.request("POST", "/v1/completions", json=body)
        assert asleep.status_code == 503 and "asleep" in asleep.json()["error"]["message"]
        assert client.request("POST", "/sleep?level=3").status_code == 400
        assert client.request("POST", "/wake_up?tags=weights").status_code == 200
        assert client.request("GET", "/is_sleeping").json() == {"is_sleeping": True}
        assert client.request("POST", "/wake_up").status_code == 200
        assert client.request("GET", "/is_sleeping").json() == {"is_sleeping": False}
        after = client.request("POST", "/v1/completions", json=body).json()
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
    finally:
        client.close()
        plain.close()
        engine.shutdown()
