"""Fault tolerance: workers that crash or hang are replaced and every request resumes with the
tokens an undisturbed run gives (greedy and seeded); an out-of-memory step is retried smaller.

Faults are injected at an exact execute_model call (fleetllm.worker.faults), so no test
depends on timing luck.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from fleetllm import LLM, SamplingParams
from fleetllm.engine.recovery import RestartBudget
from fleetllm.errors import WorkerCrashedError
from fleetllm.sequence import ExecuteModelRequest
from fleetllm.worker.faults import inject_fault

KV = 32 << 20
pytestmark = pytest.mark.timeout(300)


def workload(count: int = 64) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(4)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randint(4, 60))]}
               for _ in range(count)]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True) if i % 2 else
              SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(count)]
    return prompts, params


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def tp2(tiny_models):
    with LLM(tiny_models["llama_gqa"], tensor_parallel_size=2, kv_cache_memory=KV,
             max_num_seqs=32, max_num_batched_tokens=256, execute_model_timeout=4.0) as llm:
        prompts, params = workload()
        yield llm, prompts, params, tokens(llm.generate(prompts, params, use_tqdm=False))


@pytest.mark.parametrize("kind, rank", [("crash", 1), ("hang", 0)])
def test_a_crashed_or_hung_worker_is_replaced_and_no_request_is_lost(tp2, kind, rank):
    llm, prompts, params, undisturbed = tp2
    engine = llm.llm_engine
    executor = engine.model_executor
    restarts = executor.get_performance_metrics()["workers"]["restarts"]
    old_pids = list(executor.worker_pids)
    inject_fault(executor, rank=rank, kind=kind, at_call=6)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outputs) == undisturbed  # every request, greedy and seeded, token for token
    assert all(o.finished and o.error is None for o in outputs)
    assert executor.get_performance_metrics()["workers"]["restarts"] == restarts + 1
    assert not set(executor.worker_pids) & set(old_pids)  # every rank was replaced
    bm = engine.scheduler.block_manager
    assert bm.num_free_gpu_blocks == bm.num_gpu_blocks


def test_a_slow_step_is_waited_for_once_more_not_restarted(tp2):
    """execute_model_timeout=4: a rank 5 s late is within the second wait (as long again)."""
    llm, prompts, params, undisturbed = tp2
    executor = llm.llm_engine.model_executor
    restarts = executor.get_performance_metrics()["workers"]["restarts"]
    inject_fault(executor, rank=1, kind="hang", at_call=3, seconds=5.0)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == undisturbed
    assert executor.get_performance_metrics()["workers"]["restarts"] == restarts


def test_past_max_worker_restarts_requests_fail_with_the_typed_error(tiny_models):
    prompts, params = workload(8)
    with LLM(tiny_models["llama_gqa"], tensor_parallel_size=2, kv_cache_memory=KV,
             max_worker_restarts=1) as llm:
        engine = llm.llm_engine
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(str(i), p, sp)
        inject_fault(engine.model_executor, rank=1, kind="crash", at_call=2)
        for _ in range(3):
            engine.step()
        assert engine.worker_restarts == 1
        inject_fault(engine.model_executor, rank=0, kind="crash", at_call=1)
        with pytest.raises(WorkerCrashedError):
            for _ in range(50):
                engine.step()
    with LLM(tiny_models["llama_gqa"], tensor_parallel_size=2, kv_cache_memory=KV,
             max_worker_restarts=0) as llm:  # vLLM's behaviour: fail-stop
        inject_fault(llm.llm_engine.model_executor, rank=1, kind="crash", at_call=2)
        with pytest.raises(WorkerCrashedError):
            llm.generate(prompts, params, use_tqdm=False)


def test_restart_budget_forgets_restarts_older_than_its_window():
    now = [0.0]
    budget = RestartBudget(2, window_s=100.0, clock=lambda: now[0])
    assert budget.take() and budget.take() and not budget.take()
    now[0] = 99.0
    assert not budget.take() and budget.in_window() == 2
    now[0] = 100.0  # the first two are forgotten
    assert budget.take() and budget.in_window() == 1 and budget.total == 3
    now[0] = 150.0
    assert budget.take() and not budget.take()
    now[0] = 200.0  # the third only
    assert budget.take() and not budget.take() and budget.total == 5
    forever = RestartBudget(1, clock=lambda: now[0])  # inf: over the whole life
    assert forever.take()
    now[0] = 1e12
    assert not forever.take() and forever.total == 1
    budget.reset()
    assert budget.in_window() == 0 and budget.total == 0 and budget.take()
    assert not RestartBudget(0).take()  # fail-stop


def test_worker_restarts_count_within_a_window(tiny_models):
    """max_worker_restarts=1 per worker_restart_window_s (a fake clock): a crash an hour
    after the last restart is recovered from again; a second crash within the hour is not."""
    prompts, params = workload(8)
    now = [0.0]
    with LLM(tiny_models["llama_gqa"], tensor_parallel_size=2, kv_cache_memory=KV,
             max_worker_restarts=1, worker_restart_window_s=3600) as llm:
        engine = llm.llm_engine
        engine.restart_budget.clock = lambda: now[0]
        undisturbed = tokens(llm.generate(prompts, params, use_tqdm=False))
        inject_fault(engine.model_executor, rank=1, kind="crash", at_call=2)
        assert tokens(llm.generate(prompts, params, use_tqdm=False)) == undisturbed
        now[0] += 3600.0
        inject_fault(engine.model_executor, rank=0, kind="crash", at_call=2)
        assert tokens(llm.generate(prompts, params, use_tqdm=False)) == undisturbed
        assert engine.worker_restarts == 2
        now[0] += 3599.0
        inject_fault(engine.model_executor, rank=1, kind="crash", at_call=2)
        with pytest.raises(WorkerCrashedError):
            llm.generate(prompts, params, use_tqdm=False)
        assert engine.worker_restarts == 2


def test_an_out_of_memory_step_is_retried_with_half_the_tokens(tiny_models):
    prompts, params = workload(16)
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV, max_num_batched_tokens=512) as llm:
        undisturbed = tokens(llm.generate(prompts, params, use_tqdm=False))
        engine = llm.llm_engine
        inject_fault(engine.model_executor, rank=0, kind="oom", at_call=1)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(str(i), p, sp)
        engine.step()  # the first (prefill) step runs out of memory ...
        assert engine.scheduler.max_num_batched_tokens <= 256  # ... at most half of 512 next
        results = {}
        while engine.has_unfinished_requests():
            results.update({o.request_id: o for o in engine.step() if o.finished})
        # not grown back to the size that failed (for recovery.OOM_FORGET_STEPS good steps)
        assert engine.scheduler.max_num_batched_tokens < 512
        assert tokens([results[str(i)] for i in range(16)]) == undisturbed

        # A request that runs out of memory alone at its smallest step fails; no other does.
        engine.add_request("big", prompts[0], SamplingParams(max_tokens=8, ignore_eos=True))
        engine.step()  # its prompt
        inject_fault(engine.model_executor, rank=0, kind="oom", at_call=1)
        [out] = engine.step()  # one token: it cannot be made smaller
        assert out.finished and out.outputs[0].finish_reason == "error"
        assert "out of memory" in out.error and "E001" in out.error
        assert not engine.has_unfinished_requests()
        bm = engine.scheduler.block_manager
        assert bm.num_free_gpu_blocks == bm.num_gpu_blocks


def test_check_health_never_queues_behind_a_step_and_sees_a_dead_worker(tiny_models):
    with LLM(tiny_models["llama_gqa"], tensor_parallel_size=2, kv_cache_memory=KV,
             execute_model_timeout=3.0) as llm:
        executor = llm.llm_engine.model_executor
        start = time.monotonic()
        executor.check_health(timeout=5)  # idle: every worker pings back (a device op)
        assert time.monotonic() - start < 2
        inject_fault(executor, rank=1, kind="hang", at_call=1, seconds=2.5)
        step = threading.Thread(target=executor.execute_model,
                                args=(ExecuteModelRequest([]),))
        step.start()
        time.sleep(0.3)
        start = time.monotonic()
        executor.check_health(timeout=5)  # a step runs: answered at once, not after it
        assert time.monotonic() - start < 0.5
        step.join(10)
        assert not step.is_alive()
        os.kill(executor.worker_pids[1], signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(WorkerCrashedError):
            executor.check_health(timeout=5)
