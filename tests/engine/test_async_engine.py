"""AsyncLLMEngine: many asyncio callers over one stepping thread (issue: OpenAI server)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from serving_helpers import KV

from fleetllm import LLM, SamplingParams
from fleetllm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineUnhealthyError,
    RequestStream,
)
from fleetllm.engine.core_client import EngineCoreClient
from fleetllm.errors import EngineShutdownError, InvalidRequestError, WorkerCrashedError


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_gqa"]


@pytest.fixture(scope="module", params=["in-process", "core-process"])
def engine(model, request):
    """The same API either way: the engine on a thread of this process, or in an engine-core
    process of its own (EngineCoreClient, what `fleetllm serve` runs)."""
    start = EngineCoreClient if request.param == "core-process" else \
        AsyncLLMEngine.from_engine_args
    eng = start(str(model), kv_cache_memory=KV)
    yield eng
    eng.shutdown()


def in_process(engine) -> bool:
    return isinstance(engine, AsyncLLMEngine)


def ids(n: int, start: int = 3) -> dict:
    return {"prompt_token_ids": [(start + 7 * i) % 500 + 3 for i in range(n)]}


async def consume(engine: AsyncLLMEngine, prompt, params, request_id: str):
    """Concatenated deltas per sample, checking they always add up to the cumulative fields."""
    texts: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    final = None
    async for final in engine.generate(prompt, params, request_id):
        for c in final.outputs:
            texts[c.index] = texts.get(c.index, "") + c.delta_text
            tokens[c.index] = tokens.get(c.index, []) + c.delta_token_ids
            assert c.text == texts[c.index] and c.token_ids == tokens[c.index]
    assert final is not None and final.finished
    return texts, tokens, final


def test_streams_add_up_to_llm_generate(model, engine):
    prompts = [ids(5), ids(17, 40), "def fibonacci(n):", ids(33, 9)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    with LLM(model, kv_cache_memory=KV) as llm:
        ref_greedy = llm.generate(prompts, greedy, use_tqdm=False)
        ref_sampled = llm.generate(prompts[0], sampled, use_tqdm=False)[0]

    async def run():
        return await asyncio.gather(
            *(consume(engine, p, greedy, f"greedy-{i}") for i, p in enumerate(prompts)),
            consume(engine, prompts[0], sampled, "sampled"))

    *greedy_runs, (texts, tokens, _) = asyncio.run(run())
    for (run_texts, run_tokens, final), ref in zip(greedy_runs, ref_greedy, strict=True):
        assert run_tokens[0] == ref.outputs[0].token_ids
        assert run_texts[0] == ref.outputs[0].text
        assert final.outputs[0].finish_reason == "length"
    assert [tokens[i] for i in range(2)] == [c.token_ids for c in ref_sampled.outputs]
    assert [texts[i] for i in range(2)] == [c.text for c in ref_sampled.outputs]


def test_text_prompts_reach_the_engine_as_token_ids(engine, monkeypatch):
    if not in_process(engine):
        pytest.skip("spies on the LLMEngine (test_engine_core checks text prompts)")
    seen = []
    real = engine.engine.add_request

    def spy(request_id, prompt, params=None, arrival_time=None, lora_request=None):
        seen.append(prompt)
        return real(request_id, prompt, params, arrival_time, lora_request)

    monkeypatch.setattr(engine.engine, "add_request", spy)
    asyncio.run(consume(engine, "hello world", SamplingParams(max_tokens=2), "tok"))
    [prompt] = seen
    assert prompt["prompt"] == "hello world"
    assert prompt["prompt_token_ids"] == engine.tokenizer.encode("hello world")


def test_stop_strings_never_stream_text_that_is_taken_back(engine):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    [(texts, _, _)] = [asyncio.run(consume(engine, "import os\n", params, "nostop"))]
    full = texts[0]
    # Stops that straddle token boundaries: without the hold-back their first characters
    # would be streamed before the engine cuts the text at the stop.
    stops = [full[i:i + 3] for i in range(2, len(full) - 3, 4) if full[i:i + 3].strip()][:4]
    assert stops
    for k, stop in enumerate(stops):
        texts, _, final = asyncio.run(consume(
            engine, "import os\n", SamplingParams(temperature=0, max_tokens=24, stop=stop,
                                                  ignore_eos=True), f"stop-{k}"))
        assert texts[0] == final.outputs[0].text == full[:full.index(stop)]
        assert final.outputs[0].finish_reason == "stop"


def test_cancelled_consumer_aborts_every_sample_and_frees_blocks(engine):
    async def run():
        await asyncio.sleep(0.05)
        before = engine.load.num_free_gpu_blocks
        params = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=600, ignore_eos=True)
        started = asyncio.Event()

        async def reader():
            async for out in engine.generate(ids(40), params, "cancel-me"):
                if len(out.outputs) == 2 and len(out.outputs[1].token_ids) >= 2:
                    started.set()

        task = asyncio.create_task(reader())
        await asyncio.wait_for(started.wait(), 30)
        assert engine.load.num_free_gpu_blocks < before
        task.cancel()
        t0 = time.monotonic()
        while engine.load.num_free_gpu_blocks != before or engine.load.num_running:
            assert time.monotonic() - t0 < 1.0, engine.load
            await asyncio.sleep(0.01)
        if in_process(engine):
            assert not engine.engine.has_unfinished_requests()

    asyncio.run(run())


def test_rejected_requests_leave_the_others_alone(engine):
    async def run():
        # Long enough to be still running when the duplicate id comes (30 tokens could
        # finish while the bad requests were being refused).
        good = asyncio.create_task(consume(engine, ids(8), SamplingParams(
            temperature=0, max_tokens=600, ignore_eos=True), "good"))
        await asyncio.sleep(0.01)
        for bad in ({"prompt_token_ids": [999999]}, {"prompt_token_ids": []},
                    {"prompt_token_ids": list(range(3, 2000))}, 12345):
            with pytest.raises(InvalidRequestError):
                await engine.add_request("bad", bad, SamplingParams())
        with pytest.raises(InvalidRequestError, match="already in use"):
            await engine.add_request("good", ids(3), SamplingParams())
        _, tokens, _ = await good
        assert len(tokens[0]) == 600

    asyncio.run(run())
    engine.check_health()


def test_abort_with_an_error_ends_the_stream_with_it(engine):
    async def run():
        stream = await engine.add_request("drained", ids(6), SamplingParams(
            max_tokens=800, ignore_eos=True))
        assert isinstance(stream, RequestStream)
        await stream.__anext__()
        engine.abort_all(EngineShutdownError("the server is shutting down"))
        with pytest.raises(EngineShutdownError, match="shutting down"):
            async for _ in stream:
                pass

    asyncio.run(run())


def test_a_wedged_step_makes_the_engine_unhealthy(engine, monkeypatch):
    if not in_process(engine):
        pytest.skip("patches the LLMEngine's step (test_engine_core wedges the core's)")
    release = threading.Event()
    real_step = engine.engine.step

    def stuck_step():
        release.wait(30)
        return real_step()

    monkeypatch.setattr(engine, "step_timeout_s", 0.3)
    monkeypatch.setattr(engine.engine, "step", stuck_step)

    async def run():
        task = asyncio.create_task(consume(engine, ids(4), SamplingParams(max_tokens=3),
                                           "wedged"))
        await asyncio.sleep(0.6)
        with pytest.raises(EngineUnhealthyError, match="no engine step has completed"):
            engine.check_health()
        release.set()
        await task

    asyncio.run(run())
    engine.check_health()


def test_a_dead_engine_fails_every_stream_and_every_new_request(model):
    eng = AsyncLLMEngine.from_engine_args(str(model), kv_cache_memory=KV)
    real_step = eng.engine.step
    calls = []

    def crashing_step():
        calls.append(1)
        if len(calls) > 3:
            raise WorkerCrashedError("worker rank 1 died", rank=1, exitcode=-9)
        return real_step()

    eng.engine.step = crashing_step

    async def run():
        streams = [consume(eng, ids(5 + i), SamplingParams(max_tokens=50, ignore_eos=True),
                           f"r{i}") for i in range(3)]
        results = await asyncio.gather(*streams, return_exceptions=True)
        for r in results:
            assert isinstance(r, EngineDeadError) and isinstance(r.__cause__,
                                                                 WorkerCrashedError)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="worker rank 1 died"):
            await eng.add_request("late", ids(3), SamplingParams())
        assert time.monotonic() - t0 < 0.5

    try:
        asyncio.run(run())
        with pytest.raises(EngineDeadError):
            eng.check_health()
    finally:
        eng.shutdown()
    with pytest.raises(EngineDeadError):  # still says why, after shutdown too
        eng.check_health()
