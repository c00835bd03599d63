"""AsyncLLMEngine.encode / EngineCoreClient.encode (issue #21): one PoolingRequestOutput per
request, equal to LLM.encode's; abort, cancel, engine death and task mismatches as generate
has them; the stats count prompt tokens and no generated ones. Both engines: on a thread of
this process, and in an engine-core process (what `fleetllm serve` runs)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch
from serving_helpers import KV, make_embed_checkpoint

from fleetllm import LLM, SamplingParams
from fleetllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestAbortedError
from fleetllm.engine.core_client import EngineCoreClient
from fleetllm.engine.outputs import PoolingRequestOutput
from fleetllm.engine.stats import IterationStats
from fleetllm.errors import EngineShutdownError, InvalidRequestError, WorkerCrashedError
from fleetllm.pooling_params import PoolingParams

pytestmark = pytest.mark.timeout(300)
PROMPTS = ["def fibonacci(n):", {"prompt_token_ids": [5, 17, 300, 42, 9]}, "hello world",
           {"prompt": "import os", "prompt_token_ids": [30, 31, 32]}]


class Recorder:
    def __init__(self) -> None:
        self.stats: list[IterationStats] = []

    def record(self, stats: IterationStats) -> None:
        self.stats.append(stats)

    def total(self, field: str) -> int:
        return sum(getattr(s, field) for s in self.stats)

    def reasons(self) -> list[str]:
        return [f.finish_reason for s in self.stats for f in s.finished]


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory):
    return make_embed_checkpoint(tmp_path_factory.mktemp("embed") / "model")


@pytest.fixture(scope="module")
def reference(embed_model):
    with LLM(embed_model, task="embed", kv_cache_memory=KV) as llm:
        return llm.encode(PROMPTS, use_tqdm=False), llm.encode(
            PROMPTS, PoolingParams(normalize=False), use_tqdm=False)


@pytest.fixture(scope="module", params=["in-process", "core-process"])
def engine(embed_model, request):
    # One request per 20 ms step: requests queued behind others can be aborted in time.
    os.environ["FLEETLLM_TEST_STEP_DELAY"] = "0.02"
    start = EngineCoreClient if request.param == "core-process" else \
        AsyncLLMEngine.from_engine_args
    eng = start(str(embed_model), kv_cache_memory=KV, max_num_seqs=1,
                worker_cls="serving_helpers.SlowWorker")
    yield eng
    eng.shutdown()
    os.environ.pop("FLEETLLM_TEST_STEP_DELAY", None)


def ids(*tokens: int) -> dict:
    return {"prompt_token_ids": list(tokens)}


async def collect(engine, prompt, params, request_id: str) -> list:
    return [out async for out in engine.encode(prompt, params, request_id)]


def test_encode_yields_one_vector_equal_to_llm_encode(engine, reference):
    recorder = Recorder()
    engine.stat_loggers.append(recorder)

    async def run():
        return await asyncio.gather(
            *(collect(engine, p, None, f"plain-{i}") for i, p in enumerate(PROMPTS)),
            *(collect(engine, p, PoolingParams(normalize=False), f"raw-{i}")
              for i, p in enumerate(PROMPTS)))

    try:
        results = asyncio.run(run())
    finally:
        engine.stat_loggers.remove(recorder)
    for outs, ref in zip(results, [*reference[0], *reference[1]], strict=True):
        [out] = outs  # exactly one output, the finished one
        assert isinstance(out, PoolingRequestOutput) and out.finished and out.error is None
        assert out.outputs.data.dtype == torch.float32 and out.outputs.data.shape == (64,)
        torch.testing.assert_close(out.outputs.data, ref.outputs.data, rtol=1e-5, atol=1e-6)
        assert out.prompt_token_ids == ref.prompt_token_ids
        assert out.metrics is not None and out.metrics.finished_time is not None
    assert results[3][0].prompt == "import os"
    tokens = 2 * sum(len(r.prompt_token_ids) for r in reference[0])
    assert recorder.total("prompt_tokens") == tokens
    assert recorder.total("generation_tokens") == 0
    assert recorder.reasons() == ["stop"] * 8
    assert not any(s.time_to_first_tokens or s.inter_token_latencies for s in recorder.stats)


def test_the_wrong_task_and_bad_requests_are_refused(engine):
    async def run():
        with pytest.raises(InvalidRequestError, match="pooling model"):
            async for _ in engine.generate("hi", SamplingParams(max_tokens=2), "gen"):
                pass
        for bad in ({"prompt_token_ids": []}, {"prompt_token_ids": [999999]},
                    {"prompt_token_ids": list(range(3, 500)) * 3}):
            with pytest.raises(InvalidRequestError):
                await collect(engine, bad, None, "bad")
        with pytest.raises(InvalidRequestError, match="Matryoshka"):
            await collect(engine, "hi", PoolingParams(dimensions=8), "dims")
        return await collect(engine, "still fine", None, "after")

    [out] = asyncio.run(run())
    assert out.outputs.data is not None
    engine.check_health()


def test_abort_and_cancel_end_queued_requests_as_generate_does(engine):
    recorder = Recorder()
    engine.stat_loggers.append(recorder)

    async def run():
        tasks = [asyncio.create_task(collect(engine, ids(3 + i, 4, 5), None, f"q{i}"))
                 for i in range(8)]
        t0 = time.monotonic()  # accepted, and queued behind each other (max_num_seqs=1)
        while engine.load.num_waiting < 4:
            assert time.monotonic() - t0 < 5, engine.load
            await asyncio.sleep(0.005)
        engine.abort("q7")
        tasks[6].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[7], RequestAbortedError)
        assert isinstance(results[6], asyncio.CancelledError)
        assert all(len(r) == 1 and r[0].finished for r in results[:6])

        stream = await engine.add_request("drained", ids(9, 9, 9), PoolingParams())
        waiting = [asyncio.create_task(collect(engine, ids(7, 7), None, f"w{i}"))
                   for i in range(3)]
        await asyncio.sleep(0.01)
        engine.abort_all(EngineShutdownError("the server is shutting down"))
        ended = await asyncio.gather(*waiting, return_exceptions=True)
        assert any(isinstance(e, EngineShutdownError) for e in ended), ended
        try:
            async for _ in stream:
                pass
        except EngineShutdownError:
            pass
        t0 = time.monotonic()
        while engine.load.num_running or engine.load.num_waiting:
            assert time.monotonic() - t0 < 5, engine.load
            await asyncio.sleep(0.01)

    try:
        asyncio.run(run())
    finally:
        engine.stat_loggers.remove(recorder)
    assert recorder.reasons().count("abort") >= 2
    engine.check_health()


def test_a_dead_engine_fails_every_encode(embed_model):
    eng = AsyncLLMEngine.from_engine_args(str(embed_model), kv_cache_memory=KV, max_num_seqs=1)
    real_step = eng.engine.step
    calls = []

    def crashing_step():
        calls.append(1)
        if len(calls) > 2:
            raise WorkerCrashedError("worker rank 0 died", rank=0, exitcode=-9)
        return real_step()

    eng.engine.step = crashing_step

    async def run():
        results = await asyncio.gather(*(collect(eng, ids(3 + i, 4), None, f"r{i}")
                                         for i in range(5)), return_exceptions=True)
        assert all(len(r) == 1 for r in results[:2]), results
        for r in results[2:]:
            assert isinstance(r, EngineDeadError) and isinstance(r.__cause__,
                                                                 WorkerCrashedError)
        with pytest.raises(EngineDeadError, match="worker rank 0 died"):
            await collect(eng, ids(3, 4), None, "late")

    try:
        asyncio.run(run())
    finally:
        eng.shutdown()


def test_encode_on_a_generating_engine_names_the_task(tiny_models):
    eng = AsyncLLMEngine.from_engine_args(str(tiny_models["llama_gqa"]), kv_cache_memory=KV)

    async def run():
        with pytest.raises(InvalidRequestError, match="task='generate'"):
            await collect(eng, "hi", PoolingParams(), "embed-me")

    try:
        asyncio.run(run())
        eng.check_health()
    finally:
        eng.shutdown()
