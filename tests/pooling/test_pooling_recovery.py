"""Pooling models under faults: a crashed worker, an out-of-memory step (the token budget is
halved below a prompt's length: it must wait, not be chunked or lost), a failure while asleep,
sleep and wake. Every request still gets exactly the vector an undisturbed run gives."""

from __future__ import annotations

import os
import random
import signal

import pytest
import torch

from fleetllm import LLM
from fleetllm.pooling_params import PoolingParams
from fleetllm.worker.faults import inject_fault

pytestmark = pytest.mark.timeout(300)


def inputs(count: int, longest: int = 200) -> list[dict]:
    rng = random.Random(7)
    return [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randint(1, longest))]}
            for _ in range(count)]


def vectors(outputs) -> torch.Tensor:
    assert all(o.finished and o.error is None for o in outputs)
    return torch.stack([o.outputs.data for o in outputs])


def test_a_crashed_worker_is_replaced_and_every_vector_is_the_same(tiny_models):
    prompts = inputs(24)
    with LLM(tiny_models["llama_gqa"], task="embed", tensor_parallel_size=2,
             max_num_seqs=4, max_num_batched_tokens=256, execute_model_timeout=4.0) as llm:
        undisturbed = vectors(llm.encode(prompts, use_tqdm=False))
        executor = llm.llm_engine.model_executor
        restarts = executor.get_performance_metrics()["workers"]["restarts"]
        inject_fault(executor, rank=1, kind="crash", at_call=3)
        torch.testing.assert_close(vectors(llm.encode(prompts, use_tqdm=False)), undisturbed,
                                   rtol=1e-5, atol=1e-6)
        assert executor.get_performance_metrics()["workers"]["restarts"] == restarts + 1

        # A worker that dies while the engine sleeps is replaced when it wakes up.
        llm.sleep(level=2)
        os.kill(executor.worker_pids[1], signal.SIGKILL)
        llm.wake_up()
        assert executor.get_performance_metrics()["workers"]["restarts"] == restarts + 2
        torch.testing.assert_close(vectors(llm.encode(prompts, use_tqdm=False)), undisturbed,
                                   rtol=1e-5, atol=1e-6)


def test_an_out_of_memory_step_halves_the_budget_and_long_inputs_wait(tiny_models):
    prompts = inputs(12, longest=400)
    assert max(len(p["prompt_token_ids"]) for p in prompts) > 256  # longer than half the budget
    with LLM(tiny_models["qwen3_qknorm"], task="embed", max_num_batched_tokens=512,
             override_pooler_config={"pooling_type": "MEAN"}) as llm:
        undisturbed = vectors(llm.encode(prompts, use_tqdm=False))
        engine = llm.llm_engine
        inject_fault(engine.model_executor, rank=0, kind="oom", at_call=1)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, PoolingParams())
        assert engine.step() == []  # the first step runs out of memory
        assert engine.scheduler.max_num_batched_tokens <= 256
        results = {}
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                assert out.request_id not in results  # one output per request
                results[out.request_id] = out
        assert sorted(results, key=int) == [str(i) for i in range(12)]
        torch.testing.assert_close(vectors([results[str(i)] for i in range(12)]), undisturbed,
                                   rtol=1e-5, atol=1e-6)
        bm = engine.scheduler.block_manager
        assert bm.num_free_gpu_blocks == bm.num_gpu_blocks
