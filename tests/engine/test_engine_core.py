"""The engine core in its own process (core_proc / core_client), against the in-process
engine: same tokens for random workloads, every request one terminal output, nothing leaked;
a core killed at any moment ends every stream with an error at once; a wedged core makes
/health fail; the core goes away with its API process."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serving_helpers import KV, alive, children_of, engine_core, server_env

from fleetllm import SamplingParams
from fleetllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineUnhealthyError
from fleetllm.engine.core_client import EngineCoreClient
from fleetllm.entrypoints.openai.local_server import LocalServer


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_gqa"]


@pytest.fixture(scope="module")
def engines(model):
    """An engine-core client and an in-process engine (the reference) of the same model, for
    the tests that only run requests on both: each checks the core holds nothing after it."""
    core = EngineCoreClient(str(model), kv_cache_memory=KV)
    ref = AsyncLLMEngine.from_engine_args(str(model), kv_cache_memory=KV)
    yield core, ref
    core.shutdown()
    ref.shutdown()


def random_requests(rng: random.Random, count: int) -> list[tuple[dict, SamplingParams]]:
    out = []
    for _ in range(count):
        prompt = {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))]}
        kind = rng.random()
        if kind < 0.4:
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 24),
                                    ignore_eos=True, logprobs=rng.choice([None, 0, 2]))
        elif kind < 0.8:
            params = SamplingParams(n=rng.choice([1, 2, 3]), temperature=1.0,
                                    seed=rng.randrange(1000), max_tokens=rng.randint(1, 24),
                                    top_k=rng.choice([-1, 20]), ignore_eos=True)
        else:
            params = SamplingParams(temperature=0, max_tokens=rng.randint(4, 24),
                                    stop=[" the", "\n"], prompt_logprobs=rng.choice([None, 1]))
        out.append((prompt, params))
    return out


async def run_workload(engine, requests, rng: random.Random | None, abort_p: float = 0.0):
    """Every request streamed concurrently, a random few cancelled part-way. Returns
    {request id: ("done", final output) | ("cancelled", None) | ("error", exception)}."""
    results: dict[str, tuple] = {}

    async def one(i: int, prompt, params) -> None:
        rid = f"r{i}"
        cancel_after = rng.randint(1, 4) if rng is not None and rng.random() < abort_p else None
        final, seen = None, 0
        try:
            async for final in engine.generate(prompt, params, rid):
                seen += 1
                if cancel_after is not None and seen >= cancel_after and not final.finished:
                    results[rid] = ("cancelled", None)
                    return  # closing the generator aborts the request
        except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
            results[rid] = ("error", e)
            return
        results[rid] = ("done", final)

    await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(requests)))
    return results


def summary(out) -> list:
    return [(c.index, c.text, c.token_ids, c.finish_reason,
             None if c.logprobs is None else [sorted((t, round(lp.logprob, 4))
                                                     for t, lp in e.items())
                                              for e in c.logprobs])
            for c in out.outputs]


@pytest.mark.parametrize("seed", [0, 1])
def test_random_workloads_give_the_in_process_engine_s_tokens(engines, seed):
    core, ref = engines
    rng = random.Random(seed)
    requests = random_requests(rng, 24)
    want = asyncio.run(run_workload(ref, requests, None))
    got = asyncio.run(run_workload(core, requests, None))
    cancelled = asyncio.run(run_workload(core, requests, random.Random(seed), 0.3))
    time.sleep(0.3)
    assert core.load.num_running == core.load.num_waiting == 0
    assert core.load.num_free_gpu_blocks == core.load.num_gpu_blocks  # nothing leaked
    assert not core._streams and not core._adds
    core.check_health()
    core.check_workers()
    assert set(got) == set(want) == {f"r{i}" for i in range(len(requests))}
    for rid, (kind, out) in want.items():
        assert kind == "done" and got[rid][0] == "done", (rid, got[rid])
        assert summary(got[rid][1]) == summary(out), rid
        assert got[rid][1].prompt_logprobs == out.prompt_logprobs
    for rid, (kind, out) in cancelled.items():
        assert kind in ("done", "cancelled"), (rid, kind, out)
        if kind == "done":
            assert summary(out) == summary(want[rid][1]), rid


def test_rejections_and_text_prompts_cross_the_process_boundary(engines):
    core, ref = engines
    params = SamplingParams(temperature=0, max_tokens=8)

    async def final(engine, prompt):
        outs = [out async for out in engine.generate(prompt, params, "t")]
        return outs[-1]

    got, want = asyncio.run(final(core, "hello world")), asyncio.run(final(ref, "hello world"))
    assert got.prompt == "hello world" and got.prompt_token_ids == want.prompt_token_ids
    assert summary(got) == summary(want)
    for bad in ({"prompt_token_ids": [999999]}, {"prompt_token_ids": []}):
        with pytest.raises(type(_rejection(ref, bad))) as info:
            asyncio.run(core.add_request("bad", bad, params))
        assert str(info.value) == str(_rejection(ref, bad))
    assert not core._streams and not core._adds


def _rejection(engine, prompt) -> BaseException:
    try:
        asyncio.run(engine.add_request("bad", prompt, SamplingParams()))
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("accepted")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_core_killed_at_a_random_moment_ends_every_stream_at_once(model, seed):
    """Past the restart limit (0 here: test_engine_core_faults restarts it)."""
    rng = random.Random(seed)
    core = EngineCoreClient(str(model), kv_cache_memory=KV, max_core_restarts=0)
    pid = core._proc.pid
    try:
        requests = random_requests(rng, 16)
        for _, params in requests:  # still running when the core is killed: ~1,000 steps
            params.max_tokens = 980  # (prompts of up to 40 tokens; max_model_len 1,024)
            params.stop, params.ignore_eos = None, True

        async def run():
            task = asyncio.create_task(run_workload(core, requests, None))
            await asyncio.sleep(rng.uniform(0.0, 1.5))
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.wait_for(task, 10)
            return results, time.monotonic() - killed

        results, took = asyncio.run(run())
        assert took < 1.0
        assert len(results) == len(requests)
        for kind, err in results.values():
            assert kind == "error" and isinstance(err, EngineDeadError), (kind, err)
        with pytest.raises(EngineDeadError, match="died"):
            core.check_health()
        with pytest.raises(EngineDeadError):
            asyncio.run(core.add_request("late", {"prompt_token_ids": [5]}, SamplingParams()))
    finally:
        core.shutdown()
    assert not alive(pid)


def test_a_wedged_core_step_fails_the_health_check(model, monkeypatch):
    monkeypatch.setenv("FLEETLLM_TEST_STEP_DELAY", "3")
    core = EngineCoreClient(str(model), kv_cache_memory=KV, step_timeout_s=0.5,
                            worker_cls="serving_helpers.SlowWorker")
    try:
        async def run():
            task = asyncio.create_task(run_workload(
                core, [({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=1))], None))
            await asyncio.sleep(1.5)  # inside the first 3 s step
            with pytest.raises(EngineUnhealthyError, match="no engine step has completed"):
                await asyncio.to_thread(core.check_workers)
            return await task

        [(kind, _)] = asyncio.run(run()).values()
        assert kind == "done"
        core.check_workers()  # the step completed: healthy again
    finally:
        core.shutdown()


def test_the_core_and_its_workers_exit_when_the_api_process_is_killed(model):
    script = (
        "import sys, time\n"
        "from fleetllm.engine.core_client import EngineCoreClient\n"
        f"c = EngineCoreClient({str(model)!r}, kv_cache_memory={KV}, "
        "tensor_parallel_size=2, distributed_executor_backend='mp')\n"
        "print('CORE', c._proc.pid, flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=server_env())
    try:
        line = proc.stdout.readline()
        assert line.startswith("CORE"), line
        core = int(line.split()[1])
        workers = children_of(core)
        assert workers
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 15
        while any(alive(p) for p in [core, *workers]):
            assert time.monotonic() < deadline, [p for p in [core, *workers] if alive(p)]
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_server_whose_core_cannot_be_restarted_ends_streams_and_exits_non_zero(model):
    """Past the restart limit (0 here), streams end with the error within a second and
    the server exits 1 (a supervisor restarts it), rather than answering 503 for ever."""
    srv = LocalServer([str(model), "--kv-cache-memory", str(KV), "--max-worker-restarts", "0",
                       "--worker-cls", "serving_helpers.SlowWorker"],
                      env=server_env(FLEETLLM_TEST_STEP_DELAY="0.02"))
    try:
        core = engine_core(srv.pid)

        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
                started = [asyncio.Event() for _ in range(4)]

                async def stream(i: int) -> list:
                    body = {"prompt": [5, 6, 7 + i], "max_tokens": 300, "ignore_eos": True,
                            "stream": True}
                    events = []
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                events.append(json.loads(line[6:]))
                                started[i].set()
                    return events

                tasks = [asyncio.create_task(stream(i)) for i in range(4)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
                os.kill(core, signal.SIGKILL)
                killed = time.monotonic()
                outcome = await asyncio.wait_for(asyncio.gather(*tasks), 5)
                return outcome, time.monotonic() - killed

        outcome, ended = asyncio.run(run())
        assert ended < 1.0
        for events in outcome:
            assert "error" in events[-1] and "died" in events[-1]["error"]["message"], events[-1]
        assert srv.proc.wait(30) == 1
        assert "cannot be restarted" in srv.log()
    finally:
        srv.kill()


def _ends_dead(coro_fn, within: float = 1.0) -> None:
    """coro_fn() must raise EngineDeadError within `within` seconds (never hang)."""
    start = time.monotonic()
    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(coro_fn(), 10))
    assert time.monotonic() - start < within


@pytest.mark.parametrize("moment", ["asleep", "restarting_workers", "beside_health_probe"])
def test_a_core_killed_outside_a_step_is_reported_dead_at_once(model, moment):
    """Failures that arrive when no step runs: the engine asleep, the core busy replacing a
    crashed worker, a health probe waiting on the core's control thread."""
    core = EngineCoreClient(str(model), kv_cache_memory=KV, tensor_parallel_size=2,
                            max_core_restarts=0)
    probes: list[BaseException | None] = []
    try:
        pid = core._proc.pid
        streams = None
        if moment == "asleep":
            asyncio.run(core.sleep(1))
        elif moment == "restarting_workers":
            async def stream(i: int):
                params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
                async for _ in core.generate({"prompt_token_ids": [5, 6, 7 + i]}, params,
                                             f"s{i}"):
                    pass

            async def kill_a_worker_then_the_core():
                tasks = [asyncio.create_task(stream(i)) for i in range(3)]
                await asyncio.sleep(0.5)
                os.kill(children_of(pid)[0], signal.SIGKILL)  # the core starts a restart
                await asyncio.sleep(random.Random(0).uniform(0.05, 0.4))
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
                results = await asyncio.wait_for(
                    asyncio.gather(*tasks, return_exceptions=True), 10)
                return results, time.monotonic() - killed

            streams = asyncio.run(kill_a_worker_then_the_core())
        else:
            def probe_loop() -> None:
                end = time.monotonic() + 10
                while time.monotonic() < end:
                    try:
                        core.check_workers(timeout=2.0)
                        probes.append(None)
                    except Exception as e:  # noqa: BLE001 - what the test checks
                        probes.append(e)
                        return

            prober = threading.Thread(target=probe_loop, daemon=True)
            prober.start()
            time.sleep(0.3)
        if moment != "restarting_workers":
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        if moment == "beside_health_probe":
            prober.join(5)
            assert not prober.is_alive() and isinstance(probes[-1], EngineUnhealthyError)
            assert time.monotonic() - killed < 1.0
        if streams is not None:
            results, ended = streams
            assert ended < 1.0
            assert all(isinstance(r, EngineDeadError) for r in results), results
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not core.errored:
            time.sleep(0.01)
        with pytest.raises(EngineDeadError):
            core.check_health()
        _ends_dead(lambda: core.wake_up())
        params = SamplingParams(max_tokens=2)

        async def late_request():
            async for _ in core.generate({"prompt_token_ids": [5]}, params, "late"):
                pass

        _ends_dead(late_request)
    finally:
        core.shutdown(timeout=10)
