"""The engine-core client against bad values and a stopped core: a value the wire cannot carry
is that request's InvalidRequestError and the core serves on; a writer thread that dies makes
the engine unhealthy; a health probe that timed out never makes a later probe read its late
reply, and a timeout is reported as one; a burst of adds is applied between steps, in order."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from types import SimpleNamespace

import pytest
from serving_helpers import KV

from fleetllm import SamplingParams
from fleetllm.engine import core_wire as wire
from fleetllm.engine.async_engine import EngineDeadError, EngineUnhealthyError
from fleetllm.engine.core_client import EngineCoreClient
from fleetllm.engine.core_proc import APPLY_BURST, EngineCore
from fleetllm.errors import InvalidRequestError
from fleetllm.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def core(tiny_models):
    client = EngineCoreClient(str(tiny_models["llama_gqa"]), kv_cache_memory=KV)
    yield client
    client.shutdown()


async def _tokens(engine, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    outs = [out async for out in engine.generate({"prompt_token_ids": prompt}, params, rid)]
    return outs[-1].outputs[0].token_ids


BAD = [
    SamplingParams(max_tokens=4, stop_token_ids=[18446744073709551616]),
    SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        json={"type": "integer", "minimum": -(2 ** 63) - 1})),
    SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        json={"type": "integer", "maximum": 2 ** 70})),
    SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="\ud800")),
    SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        choice=["a", "\udfff"])),
]


def test_an_unencodable_value_is_that_request_s_error_and_the_core_serves_on(core):
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run():
        for i, params in enumerate(BAD):
            try:
                await core.add_request(f"bad{i}", {"prompt_token_ids": [5, 6]}, params)
            except InvalidRequestError as e:
                assert "cannot be sent" in str(e)
            except Exception as e:  # noqa: BLE001 - the engine itself may refuse it first
                # (e.g. stop ids checked in the API process): a 400, never a dead writer
                assert isinstance(e, ValueError), repr(e)
            else:
                raise AssertionError(f"accepted {params}")
            # nothing was queued for it, and the next request is served
            assert f"bad{i}" not in core._adds and f"bad{i}" not in core._streams
            assert len(await _tokens(core, f"ok{i}", [5, 6, 7], plain)) == 4

    asyncio.run(asyncio.wait_for(run(), 60))
    assert core._writer.is_alive()
    core.check_health()


def test_a_dead_writer_thread_makes_the_engine_unhealthy(tiny_models):
    client = EngineCoreClient(str(tiny_models["llama_gqa"]), kv_cache_memory=KV)
    try:
        client.check_health()
        client._outbox.put(None)  # not a (kind, body) pair: the writer thread dies of it
        client._writer.join(5)
        assert not client._writer.is_alive()
        with pytest.raises(EngineUnhealthyError, match="has stopped"):
            client.check_health()
        start = time.monotonic()
        client.shutdown()  # sends the stop itself: the core ends now, not after the timeout
        assert time.monotonic() - start < 15 and not client._proc.is_alive()
    finally:
        client.shutdown()


def test_a_timed_out_probe_is_a_timeout_and_later_probes_are_not_stale(core):
    core.check_workers(timeout=1.0)
    pid = core._proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(EngineUnhealthyError, match="did not answer") as info:
            core.check_workers(timeout=0.2)
        assert not isinstance(info.value, EngineDeadError)
        assert time.monotonic() - start < 10
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.5)  # the late reply to that probe arrives now
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        # Stopped again: the probe must wait for its own reply (the old code read the late
        # one and said healthy in 0.0 s).
        with pytest.raises(EngineUnhealthyError, match="did not answer"):
            core.check_workers(timeout=0.2)
        assert time.monotonic() - start > 4.0
    finally:
        os.kill(pid, signal.SIGCONT)
    core.check_workers(timeout=1.0)
    core.check_health()


class _RecordingEngine:
    """What EngineCore needs of an LLMEngine, recording the order of adds, aborts and steps."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.unfinished: set[str] = set()
        self.model_executor = SimpleNamespace(is_sleeping=False)

    def has_unfinished_requests(self) -> bool:
        return bool(self.unfinished)

    def check_health(self) -> None:
        pass

    def add_request(self, request_id, *_args) -> None:
        self.events.append(("add", request_id))
        self.unfinished.add(request_id)

    def abort_request(self, request_id) -> None:
        self.events.append(("abort", request_id))
        self.unfinished.discard(request_id)

    def step(self) -> list:
        self.events.append(("step",))
        return []


def test_a_burst_of_adds_is_applied_between_steps_in_order():
    engine = _RecordingEngine()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    core = EngineCore(engine, theirs, 60.0, 5.0)
    core._load = lambda: wire.load_msg(wire.EngineLoad())
    params = wire.params_msg(SamplingParams(max_tokens=1))
    count = 4 * APPLY_BURST + 7
    sent = []
    for i in range(count):  # all read at once, as a burst from the API process would be
        sent.append(("add", f"r{i}"))
        core.pending.append(["add", f"r{i}", None, [5], params, 0.0, None])
        if i % 97 == 0:
            sent.append(("abort", f"r{i}"))
            core.pending.append(["abort", f"r{i}"])
    core.pending.append(["stop"])

    def drain() -> None:  # the API process's reader: the core's sends never block
        while wire.recv(ours) is not None:
            pass

    threading.Thread(target=drain, daemon=True).start()
    assert core.run() == 0
    theirs.close()
    ours.close()
    applied = [e for e in engine.events if e[0] != "step"]
    assert applied == sent  # every add and abort, in the order sent
    first_step = engine.events.index(("step",))
    assert first_step <= APPLY_BURST  # a step came after the first burst, not the last
    steps = engine.events.count(("step",))
    assert steps >= count // APPLY_BURST
