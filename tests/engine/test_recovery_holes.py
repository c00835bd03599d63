"""Recovery holes found in review (issue "Hardening II", defects 1-7 and 9): every failure,
wherever it arrives (idle, asleep, during a restart, beside a health probe, during a timed-out
step, with SIGTERM), goes through the one recovery path, and nothing hangs."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from fault_workers import FAIL_LOAD_FLAG_ENV, OOM_ABOVE_ENV, MemoryLimitedWorker
from serving_helpers import REPO, alive, server_env

from fleetllm import LLM, SamplingParams
from fleetllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from fleetllm.errors import EngineShutdownError, OutOfMemoryError, WorkerCrashedError
from fleetllm.worker.faults import inject_fault

KV = 32 << 20
pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(10 + i, 40 + 3 * i))} for i in range(6)]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


async def collect(engine: AsyncLLMEngine, prompt, rid: str) -> list[int]:
    final = None
    async for out in engine.generate(prompt, GREEDY, rid):
        final = out
    return final.outputs[0].token_ids


def probing_engine(model) -> AsyncLLMEngine:
    """mp TP=2 behind AsyncLLMEngine, probing its idle workers every 0.2 s."""
    return AsyncLLMEngine.from_engine_args(model, tensor_parallel_size=2, kv_cache_memory=KV,
                                           health_probe_interval_s=0.2)


# ------------------------------------------------------------------------ 1. idle death


def test_a_worker_killed_while_the_server_engine_is_idle_is_replaced(tiny_models):
    async def main():
        engine = probing_engine(tiny_models["llama_gqa"])
        try:
            before = await collect(engine, PROMPTS[0], "a")
            executor = engine.engine.model_executor
            os.kill(executor.worker_pids[1], signal.SIGKILL)
            await asyncio.to_thread(wait_for, lambda: engine.engine.worker_restarts == 1,
                                    30, "the idle probe's restart")
            await asyncio.sleep(1.0)  # several more probes: the engine stays alive
            assert not engine.errored
            engine.check_health()
            assert await collect(engine, PROMPTS[0], "b") == before
            assert engine.load.worker_restarts == 1  # /metrics sees it
        finally:
            engine.shutdown()

    asyncio.run(main())


# ------------------------------------------------------------------ 2. death while asleep


@pytest.mark.parametrize("level", [1, 2])
def test_a_worker_that_dies_while_asleep_is_replaced_by_wake_up(tiny_models, level):
    with LLM(tiny_models["llama_gqa"], tensor_parallel_size=2, kv_cache_memory=KV) as llm:
        executor = llm.llm_engine.model_executor
        before = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        llm.sleep(level)
        os.kill(executor.worker_pids[0], signal.SIGKILL)
        time.sleep(0.3)
        llm.wake_up(["weights"])  # the new workers come back asleep, then this part wakes
        assert llm.llm_engine.worker_restarts == 1
        assert executor.is_sleeping and executor.sleeping_tags == {"kv_cache"}
        llm.wake_up()
        assert not executor.is_sleeping
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == before


def test_the_idle_probe_replaces_a_dead_worker_of_a_sleeping_engine(tiny_models):
    async def main():
        engine = probing_engine(tiny_models["llama_gqa"])
        try:
            before = await collect(engine, PROMPTS[1], "a")
            await engine.sleep(1)
            os.kill(engine.engine.model_executor.worker_pids[1], signal.SIGKILL)
            await asyncio.to_thread(wait_for, lambda: engine.engine.worker_restarts == 1,
                                    30, "the probe's restart")
            assert engine.is_sleeping and not engine.errored  # still asleep, as it was
            await engine.wake_up()
            assert await collect(engine, PROMPTS[1], "b") == before
        finally:
            engine.shutdown()

    asyncio.run(main())


# ------------------------------------------------------------- 3. a restart that fails


def test_a_failed_restart_leaves_the_executor_restartable(tiny_models, tmp_path, monkeypatch):
    flag = tmp_path / "fail-next-load"
    monkeypatch.setenv(FAIL_LOAD_FLAG_ENV, str(flag))
    with LLM(tiny_models["llama_gqa"], tensor_parallel_size=2, kv_cache_memory=KV,
             worker_cls="fault_workers.FailOnceLoadWorker") as llm:
        engine = llm.llm_engine
        executor = engine.model_executor
        before = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        # The executor alone: a failed restart raises WorkerCrashedError, not shutdown.
        flag.touch()
        with pytest.raises(WorkerCrashedError, match="restarting the workers failed"):
            executor.restart_failed_workers()
        with pytest.raises(WorkerCrashedError):
            executor.check_health(timeout=5)
        executor.restart_failed_workers()  # the cause is gone: this one works
        executor.check_health(timeout=5)
        # Through the engine: a crash, a restart that fails once, a second that works.
        flag.touch()
        inject_fault(executor, rank=1, kind="crash", at_call=2)
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == before
        assert engine.worker_restarts == 2
    with pytest.raises(EngineShutdownError):
        executor.restart_failed_workers()  # after shutdown: nothing to restart


# --------------------------------------------------------- 4. real out-of-memory errors


def test_a_real_cpu_allocation_failure_is_retried_smaller_and_not_regrown(tiny_models,
                                                                       monkeypatch):
    monkeypatch.setenv(OOM_ABOVE_ENV, "0:150")
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(40)]}
               for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV, max_num_batched_tokens=512) as llm:
        undisturbed = tokens(llm.generate(prompts, params, use_tqdm=False))
    MemoryLimitedWorker.oom_count = 0
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV, max_num_batched_tokens=512,
             worker_cls="fault_workers.MemoryLimitedWorker") as llm:
        assert tokens(llm.generate(prompts, params, use_tqdm=False)) == undisturbed
        assert llm.llm_engine.scheduler.max_num_batched_tokens <= 150
        # 512 -> 256 -> 128: two failures, never a third from growing back past the limit
        assert MemoryLimitedWorker.oom_count == 2
        assert llm.llm_engine.worker_restarts == 0


def test_an_oom_after_a_collective_restarts_the_workers_and_shrinks_the_step(tiny_models,
                                                                            monkeypatch):
    """Under TP an OOM on one rank after the step's collectives leaves the ranks out of step:
    the executor fails with WorkerCrashedError, whose cause is the OutOfMemoryError. The
    engine replaces the workers and halves the step, instead of restarting at the same size
    until max_worker_restarts."""
    monkeypatch.setenv(OOM_ABOVE_ENV, "1:150")
    prompts = [{"prompt_token_ids": [(5 * i + j) % 500 + 3 for j in range(40)]}
               for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(tiny_models["llama_gqa"], tensor_parallel_size=2, kv_cache_memory=KV,
             max_num_batched_tokens=256) as llm:
        undisturbed = tokens(llm.generate(prompts, params, use_tqdm=False))
    with LLM(tiny_models["llama_gqa"], tensor_parallel_size=2, kv_cache_memory=KV,
             max_num_batched_tokens=256, worker_cls="fault_workers.MemoryLimitedWorker",
             max_worker_restarts=3) as llm:
        engine = llm.llm_engine
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        error = None
        real_recover = engine._recover

        def spy(sched, e):
            nonlocal error
            error = error or e
            return real_recover(sched, e)

        engine._recover = spy
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert isinstance(error, WorkerCrashedError)
        assert isinstance(error.__cause__, OutOfMemoryError)
        assert tokens([done[str(i)] for i in range(12)]) == undisturbed
        assert engine.worker_restarts == 1
        assert engine.scheduler.max_num_batched_tokens == 128


# ------------------------------------------------------------- 5. one lock, probes beside


def test_a_probe_or_scrape_during_a_timed_out_step_does_not_give_it_up(tiny_models):
    """A slow step times out once; between that and the engine's second wait, another thread
    checks health and scrapes metrics. Neither may give up the step (which kills the
    workers): the step completes, no restart."""
    with LLM(tiny_models["llama_gqa"], tensor_parallel_size=2, kv_cache_memory=KV,
             execute_model_timeout=1.5) as llm:
        engine = llm.llm_engine
        executor = engine.model_executor
        before = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        seen: dict[str, object] = {}
        real_wait = executor.wait_for_timed_out_step

        def probe_then_wait():
            def probe():
                try:
                    executor.check_health(timeout=1)
                    seen["health"] = "ok"
                except Exception as e:  # reporting the slow step is fine; killing it is not
                    seen["health"] = e

            def scrape():
                seen["metrics"] = executor.get_performance_metrics()

            prober = threading.Thread(target=probe)
            prober.start()
            prober.join(10)
            scraper = threading.Thread(target=scrape)
            scraper.start()
            seen["scraper"] = scraper
            time.sleep(0.2)  # the scrape waits for the window to close
            assert scraper.is_alive()
            return real_wait()

        executor.wait_for_timed_out_step = probe_then_wait
        inject_fault(executor, rank=1, kind="hang", at_call=2, seconds=2.5)
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == before
        assert "health" in seen and not isinstance(seen["health"], WorkerCrashedError)
        seen["scraper"].join(15)
        assert seen["metrics"]["workers"]["active"] == 2
        assert engine.worker_restarts == 0


def test_restarts_and_calls_from_other_threads_are_serialised(tiny_models):
    with LLM(tiny_models["llama_gqa"], tensor_parallel_size=2, kv_cache_memory=KV) as llm:
        executor = llm.llm_engine.model_executor
        stop = threading.Event()
        unexpected: list[BaseException] = []

        def hammer():
            while not stop.is_set():
                try:
                    executor.collective_rpc("check_health", timeout=20)
                    executor.check_health(timeout=20)
                    executor.get_performance_metrics()
                except WorkerCrashedError as e:  # "being restarted": a typed, honest answer
                    if "being restarted" not in str(e):
                        unexpected.append(e)
                except Exception as e:
                    unexpected.append(e)

        threads = [threading.Thread(target=hammer) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for _ in range(2):
                executor.restart_failed_workers()
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not unexpected, unexpected
        assert executor.get_performance_metrics()["workers"]["restarts"] == 2
        assert llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)


# --------------------------------------------------------------- 6. SIGTERM in a failure


def test_sigterm_while_the_driver_handles_a_failure_does_not_deadlock(tiny_models):
    """SIGTERM lands while the driver is stopping its workers (holding the group's locks on
    the main thread, as fail() does): the driver still dies by SIGTERM, workers with it."""
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        from fleetllm import LLM
        llm = LLM({str(tiny_models["llama_gqa"])!r}, tensor_parallel_size=2,
                  kv_cache_memory={KV})
        group = llm.llm_engine.model_executor._group
        print("PIDS", *group.pids, flush=True)
        with group.lock, group.proc_lock:  # as inside fail() -> stop_processes()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        print("SURVIVED", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=server_env(), cwd=REPO)
    try:
        first = proc.stdout.readline()
        assert first.startswith("PIDS"), first
        pids = [int(p) for p in first.split()[1:]]
        assert proc.wait(timeout=20) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_for(lambda: not any(alive(p) for p in pids), 10, "the workers to go")


# ---------------------------------------------------- 7. executor-level sleep and the cache


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_executor_level_sleep_makes_the_engine_forget_cached_prefixes(tiny_models, backend):
    prompt = {"prompt_token_ids": [(3 * j) % 500 + 3 for j in range(70)]}
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV, enable_prefix_caching=True,
             distributed_executor_backend=backend) as llm:
        [first] = tokens(llm.generate(prompt, GREEDY, use_tqdm=False))
        executor = llm.llm_engine.model_executor
        executor.sleep(1)  # the executor's own API: the engine is not told
        executor.wake_up()
        [again] = tokens(llm.generate(prompt, GREEDY, use_tqdm=False))
        assert again == first


# --------------------------------------------------------- 9. queued calls of a dead engine


def test_a_sleep_queued_when_the_engine_dies_fails_instead_of_hanging(tiny_models):
    async def main():
        engine = AsyncLLMEngine.from_engine_args(tiny_models["llama_gqa"], kv_cache_memory=KV)
        try:
            executor = engine.engine.model_executor
            inject_fault(executor, rank=0, kind="raise", at_call=1)  # not recoverable
            inject_fault(executor, rank=0, kind="hang", at_call=1, seconds=1.0)  # first: slow
            request = asyncio.ensure_future(collect(engine, PROMPTS[0], "a"))
            await asyncio.sleep(0.3)  # the step is running; sleep queues behind it
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(engine.sleep(1), timeout=15)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(request, timeout=15)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(engine.wake_up(), timeout=15)
        finally:
            engine.shutdown()

    asyncio.run(main())
