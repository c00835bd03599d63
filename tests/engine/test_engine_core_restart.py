"""The engine-core process dies (SIGKILL): a new core is started and every request goes on
from the tokens it streamed (greedy and seeded: the undisturbed run's tokens), also when the
core is killed idle, mid-stream, or again while its successor starts; a server counts it in
/metrics; a sleeping core comes back asleep; SIGTERM while `fleetllm serve` starts leaves no
process behind. (Past the limit: test_engine_core.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import pytest
from serving_helpers import (
    KV,
    _cmdline,
    alive,
    children_of,
    engine_core,
    metric,
    metric_values,
    server_env,
)

from fleetllm import SamplingParams
from fleetllm.engine.core_client import EngineCoreClient
from fleetllm.entrypoints.openai.local_server import LocalServer
from fleetllm.errors import EngineSleepingError


async def _tokens(engine, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    outs = [out async for out in engine.generate({"prompt_token_ids": prompt}, params, rid)]
    return outs[-1].outputs[0].token_ids


def _kill_new_core_while_it_starts(known: set[int], deadline: float) -> int | None:
    """Wait for a new child process (the core started after one died: not in `known`) and
    SIGKILL it before it is ready."""
    while time.monotonic() < deadline:
        for pid in children_of(os.getpid()):
            if pid not in known and "resource_tracker" not in _cmdline(pid):
                os.kill(pid, signal.SIGKILL)
                return pid
        time.sleep(0.005)
    return None


def _nothing_left(shm_before: set[str], procs_before: set[int], within: float = 15.0) -> None:
    """No new process of ours but the resource tracker, no shared memory left."""
    deadline = time.monotonic() + within
    while True:
        left = [p for p in children_of(os.getpid()) if p not in procs_before
                and alive(p) and "resource_tracker" not in _cmdline(p)]
        shm = set(os.listdir("/dev/shm")) - shm_before
        if not left and not shm:
            return
        assert time.monotonic() < deadline, (left, shm)
        time.sleep(0.1)


def _same_tokens(got, want, rid: str) -> None:
    """The same tokens, text and finish, and logprobs for the same ids (values to 1e-3: a
    resumed request's tokens are recomputed in a prefill, whose float sums may round in
    another order than the decode steps that first computed them)."""
    assert len(got.outputs) == len(want.outputs), rid
    for g, w in zip(got.outputs, want.outputs, strict=True):
        assert (g.index, g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
            (w.index, w.token_ids, w.text, w.finish_reason, w.stop_reason), rid
        assert (g.logprobs is None) == (w.logprobs is None), rid
        for ge, we in zip(g.logprobs or [], w.logprobs or [], strict=True):
            assert set(ge) == set(we), rid
            assert all(abs(ge[t].logprob - we[t].logprob) < 1e-3 for t in ge), rid


def _stream_is_consistent(outs) -> bool:
    """Every output extends the one before it (no gap, no duplicate); one terminal."""
    for before, after in zip(outs, outs[1:], strict=False):
        for b, a in zip(before.outputs, after.outputs, strict=False):
            if a.token_ids[:len(b.token_ids)] != b.token_ids or not a.text.startswith(b.text):
                return False
    return [o.finished for o in outs].count(True) == 1 and outs[-1].finished


@pytest.mark.parametrize("seed", [0, 1])
def test_a_killed_core_is_replaced_and_every_stream_goes_on_with_the_same_tokens(
        tiny_models, monkeypatch, seed):
    from test_engine_core import random_requests

    monkeypatch.setenv("FLEETLLM_TEST_STEP_DELAY", "0.01")
    rng = random.Random(seed)
    requests = random_requests(rng, 12)
    for _, params in requests:
        params.max_tokens = rng.randint(20, 60)
    kwargs = dict(kv_cache_memory=KV, worker_cls="serving_helpers.SlowWorker")
    model = str(tiny_models["llama_gqa"])

    async def run(engine, kills: int):
        """kills: 0, or 2: the idle core (the requests then arrive while a new one starts),
        a core mid-stream, and a core mid-stream again with its successor while it starts."""
        outs: dict[str, list] = {}

        async def one(i, prompt, params):
            outs[f"r{i}"] = [o async for o in engine.generate(prompt, params, f"r{i}")]

        pid = engine._core.proc.pid if kills else None
        if kills:  # idle: the requests are added while a new core starts
            os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.05)
        task = asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(requests)))
        task = asyncio.ensure_future(task)
        for k in range(kills):
            while engine._restarting or engine._core.proc.pid == pid:  # the last restart
                await asyncio.sleep(0.01)
            await asyncio.sleep(rng.uniform(0.1, 0.5))
            pid = engine._core.proc.pid
            known = set(children_of(os.getpid()))
            os.kill(pid, signal.SIGKILL)
            if k == 1:  # the second time, also the new core while it starts
                assert await asyncio.to_thread(_kill_new_core_while_it_starts, known,
                                               time.monotonic() + 10)
        await asyncio.wait_for(task, 120)
        return outs

    ref = EngineCoreClient(model, **kwargs)
    try:
        want = asyncio.run(run(ref, 0))
    finally:
        ref.shutdown()
    shm_before, procs_before = set(os.listdir("/dev/shm")), set(children_of(os.getpid()))
    core = EngineCoreClient(model, max_core_restarts=4, **kwargs)  # default: 3 per hour
    try:
        got = asyncio.run(run(core, 2))
        assert core.core_restarts.total == 4  # three kills, and one core killed starting
        core.check_health()
        core.check_workers()
        assert core.load.engine_core_restarts == 4
        assert not core._streams and not core._adds and not core._calls
    finally:
        core.shutdown()
    _nothing_left(shm_before, procs_before)
    for rid, outs in want.items():
        assert _stream_is_consistent(got[rid]), rid
        _same_tokens(got[rid][-1], outs[-1], rid)


def test_a_server_s_killed_core_is_replaced_streams_complete_and_metrics_count_it(tiny_models):
    model = str(tiny_models["llama_gqa"])
    srv = LocalServer([model, "--kv-cache-memory", str(KV),
                       "--worker-cls", "serving_helpers.SlowWorker"],
                      env=server_env(FLEETLLM_TEST_STEP_DELAY="0.02"))
    try:
        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                started = [asyncio.Event() for _ in range(3)]

                async def stream(i: int) -> list[int]:
                    body = {"prompt": [5, 6, 7 + i], "max_tokens": 60, "ignore_eos": True,
                            "temperature": 0, "stream": True}
                    text = []
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                event = json.loads(line[6:])
                                assert "error" not in event, event
                                text.append(event["choices"][0]["text"])
                                started[i].set()
                    return "".join(text)

                plain = [await client.post("/v1/completions", json={
                    "prompt": [5, 6, 7 + i], "max_tokens": 60, "ignore_eos": True,
                    "temperature": 0}) for i in range(3)]
                tasks = [asyncio.create_task(stream(i)) for i in range(3)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
                os.kill(engine_core(srv.pid), signal.SIGKILL)
                texts = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                health = await client.get("/health")
                metrics = (await client.get("/metrics")).text
                return [p.json()["choices"][0]["text"] for p in plain], texts, health, metrics

        want, texts, health, metrics = asyncio.run(run())
        assert texts == want  # greedy: the same text, no gap, no duplicate
        assert health.status_code == 200
        assert metric(metric_values(metrics), "fleetllm:engine_core_restarts_total") == 1, \
            srv.log()
        assert srv.proc.poll() is None
    finally:
        srv.stop()


def test_sigterm_while_the_server_starts_leaves_no_process_behind(tiny_models, tmp_path):
    """SIGTERM to `fleetllm serve` while its engine core (TP=2, mp workers) is starting:
    every process of the tree is gone within a timeout (they used to run on under pid 1)."""
    model = str(tiny_models["llama_gqa"])
    cmd = [sys.executable, "-m", "fleetllm.cli", "serve", model, "--port", "0",
           "--kv-cache-memory", str(KV), "--tensor-parallel-size", "2",
           "--distributed-executor-backend", "mp", "--worker-cls",
           "slow_start_worker.SlowStartWorker"]  # loads for 5 s: SIGTERM lands in start-up
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=server_env(PYTHONFAULTHANDLER="1"),
                            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the core has started its workers
            tree = _tree(proc.pid)
            seen |= tree
            if any(children_of(p) for p in children_of(proc.pid)
                   if "resource_tracker" not in _cmdline(p)):
                break
            assert proc.poll() is None, "the server exited by itself"
            time.sleep(0.02)
        else:
            raise AssertionError("no workers started")
        seen |= _tree(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)
        try:
            assert proc.wait(60) != 0
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGABRT)  # faulthandler: where it was stuck
            proc.wait(10)
            raise AssertionError((tmp_path / "serve.log").read_text()[-6000:]) from None
        deadline = time.monotonic() + 30
        while left := [p for p in seen if alive(p)]:
            assert time.monotonic() < deadline, left
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in seen:  # nothing of it may outlive the test, whatever it asserted
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()


def _tree(pid: int) -> set[int]:
    out = {pid}
    for child in children_of(pid):
        out |= _tree(child)
    return out


def test_a_sleeping_core_that_dies_is_replaced_asleep(tiny_models):
    client = EngineCoreClient(str(tiny_models["llama_gqa"]), kv_cache_memory=KV)
    try:
        asyncio.run(client.sleep(1))
        pid = client._core.proc.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 180
        while client._core.proc.pid == pid or client._restarting or not client.is_sleeping:
            assert time.monotonic() < deadline, (client._core.proc.pid, pid,
                                                 client._restarting, client.is_sleeping)
            time.sleep(0.05)
        assert client.core_restarts.total == 1
        plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        with pytest.raises(EngineSleepingError):  # the new core was put to sleep first
            asyncio.run(_tokens(client, "asleep", [5, 6], plain))
        asyncio.run(client.wake_up())
        assert not client.is_sleeping
        assert len(asyncio.run(_tokens(client, "after", [5, 6], plain))) == 3
    finally:
        client.shutdown()


def test_a_killed_tp2_core_is_replaced_with_its_workers_and_nothing_is_left(tiny_models,
                                                                            monkeypatch):
    """TP=2 (mp workers under the core): the dead core's workers go, the new core's take over,
    the streams give the tokens of an undisturbed run, and nothing is left after shutdown."""
    monkeypatch.setenv("FLEETLLM_TEST_STEP_DELAY", "0.01")
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=40, ignore_eos=True)]
    shm_before, procs_before = set(os.listdir("/dev/shm")), set(children_of(os.getpid()))
    core = EngineCoreClient(str(tiny_models["llama_gqa"]), kv_cache_memory=KV,
                            tensor_parallel_size=2, distributed_executor_backend="mp",
                            worker_cls="serving_helpers.SlowWorker")

    async def run(tag: str, kill: bool):
        async def one(i, p):
            return [o async for o in core.generate({"prompt_token_ids": [5, 6, 7 + i]}, p,
                                                   f"{tag}{i}")]
        task = asyncio.ensure_future(asyncio.gather(*(one(i, p) for i, p in enumerate(params))))
        if kill:
            await asyncio.sleep(0.5)
            old = core._core.proc.pid
            workers = children_of(old)
            assert workers
            os.kill(old, signal.SIGKILL)
            outs = await asyncio.wait_for(task, 120)
            return outs, workers
        return await asyncio.wait_for(task, 120), []

    try:
        want, _ = asyncio.run(run("ref", False))
        got, old_workers = asyncio.run(run("got", True))
        assert core.core_restarts.total == 1
        deadline = time.monotonic() + 15  # they watch their core: gone within ~1 s
        while any(alive(p) for p in old_workers):
            assert time.monotonic() < deadline, old_workers
            time.sleep(0.1)
        for g, w in zip(got, want, strict=True):
            assert _stream_is_consistent(g)
            _same_tokens(g[-1], w[-1], g[-1].request_id)
    finally:
        core.shutdown()
    _nothing_left(shm_before, procs_before)
