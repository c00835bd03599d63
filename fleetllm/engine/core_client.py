"""EngineCoreClient: AsyncLLMEngine's API with the engine in its own process (core_proc).

The API process keeps what talks to clients: streams (RequestStream), tokenization, request
statistics for the metrics, the load snapshot for /metrics. Commands go to the core through a
writer thread (an event loop never blocks on a socket); a reader thread turns each step's
deltas back into cumulative RequestOutputs (core_wire.RequestState), or a pooling request's
PoolingRequestOutput (core_wire.PoolingState), and hands them to their streams, one wake-up
per event loop per step, as the in-process engine does.

Failures: the core recovers its own workers. If the core process dies (or reports a fatal
error), the reader sees it at once (EOF on the data socket): every open stream and every
waiting add or sleep/wake_up raises EngineDeadError, check_health raises it (/health: 503), and
later calls fail fast with it. shutdown() asks the core to stop, then terminates and kills it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import queue
import select
import socket
import threading
import time
from typing import Any

from fleetllm.config import EngineConfig
from fleetllm.engine import core_wire as wire
from fleetllm.engine.async_engine import AsyncLLMEngine as _Front
from fleetllm.engine.async_engine import (
    EngineDeadError,
    EngineUnhealthyError,
    RequestAbortedError,
    _dead,
    _settle,
)
from fleetllm.engine.async_stream import RequestStream, deliver_threadsafe
from fleetllm.engine.core_proc import run_engine_core
from fleetllm.engine.llm_engine import PromptType
from fleetllm.engine.stats import (
    EngineLoad,
    IterationStats,
    RequestStatsTracker,
    StatLogger,
    record_stats,
)
from fleetllm.engine.tokenizer import load_tokenizer
from fleetllm.errors import EngineShutdownError, InvalidRequestError
from fleetllm.executor.multiproc import _main_not_reimported
from fleetllm.lora.request import LoRARequest
from fleetllm.pooling_params import PoolingParams
from fleetllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_STOP = object()
START_TIMEOUT_S = 600.0  # loading a big checkpoint is slow; a dead core is seen at once


class EngineCoreClient:
    def __init__(self, model: str, *, step_timeout_s: float = 60.0,
                 health_probe_interval_s: float = 5.0,
                 stat_loggers: list[StatLogger] | None = None, **engine_kwargs: Any):
        self.config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
        self.model_config = self.config.model_config
        self.step_timeout_s = step_timeout_s
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.load = EngineLoad()
        self.tokenizer = load_tokenizer(self.model_config.tokenizer)
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="fleetllm-tokenizer")
        self._lock = threading.Lock()
        self._fatal: BaseException | None = None
        self._stopped = False
        self._sleeping = False
        self._streams: dict[str, tuple[RequestStream,
                                       wire.RequestState | wire.PoolingState]] = {}
        # request id -> [accepted, stream, state, arrival time, the error its stream ends with
        # when it was aborted before it was accepted (else None)]
        self._adds: dict[str, list[Any]] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._tracker = RequestStatsTracker()
        self._outbox: queue.Queue[Any] = queue.Queue()
        self._control_lock = threading.Lock()
        self._probe_ids = itertools.count()
        self._writer_done = False

        data, core_data = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._control, core_control = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # One byte per abort: the core's interrupt thread ends a multi-step call under way
        # (the abort itself is read between steps, from the data socket).
        self._interrupts, core_interrupts = socket.socketpair(socket.AF_UNIX,
                                                              socket.SOCK_STREAM)
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(
            target=run_engine_core, name="fleetllm-engine-core",
            args=(model, engine_kwargs, core_data, core_control, core_interrupts,
                  step_timeout_s, health_probe_interval_s,
                  logging.getLogger().getEffectiveLevel()))
        with _main_not_reimported():
            self._proc.start()
        core_data.close()
        core_control.close()
        core_interrupts.close()
        self._data = data
        self._control_frames = wire.FrameBuffer()
        first = self._await_ready(data)
        if first is not None:  # the engine could not be built
            self._proc.join(10)
            self._tokenizer_pool.shutdown(wait=False)
            data.close()
            self._control.close()
            self._interrupts.close()
            raise first
        self._reader = threading.Thread(target=self._read, name="fleetllm-core-reader",
                                        daemon=True)
        self._writer = threading.Thread(target=self._write, name="fleetllm-core-writer",
                                        daemon=True)
        self._reader.start()
        self._writer.start()

    def _await_ready(self, data: socket.socket) -> BaseException | None:
        data.settimeout(START_TIMEOUT_S)
        try:
            msg = wire.recv(data)
        except TimeoutError:
            self._proc.kill()
            return EngineDeadError(f"the engine core did not start within "
                                   f"{START_TIMEOUT_S:g} s")
        finally:
            data.settimeout(None)
        if msg is None:
            self._proc.join(5)
            return EngineDeadError(f"the engine core process exited while starting (exit "
                                   f"code {self._proc.exitcode}; its error is on stderr)")
        if msg[0] == "dead":
            return wire.load_error(msg[1])
        return None

    # ---------------------------------------------------------------- caller side

    generate = _Front.generate
    encode = _Front.encode
    run_in_tokenizer_thread = _Front.run_in_tokenizer_thread
    tokenize = _Front.tokenize
    _tokenized = _Front._tokenized
    _raise_if_unusable = _Front._raise_if_unusable
    errored = _Front.errored

    async def add_request(self, request_id: str, prompt: PromptType,
                          params: SamplingParams | PoolingParams | None = None,
                          arrival_time: float | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        arrival_time = arrival_time or time.time()
        params = params if params is not None else SamplingParams()
        self._raise_if_unusable()
        prompt = await self._tokenized(prompt)
        text, token_ids = _prompt_parts(prompt)
        stream = RequestStream(request_id, self)
        kind = wire.PoolingState if isinstance(params, PoolingParams) else wire.RequestState
        state = kind(request_id, text, token_ids or [])
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._raise_if_unusable()
            if request_id in self._adds or request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            # Encoded here: a value the wire cannot carry is this request's 400, and
            # nothing is queued.
            body = wire.encode(["add", request_id, text, token_ids, wire.params_msg(params),
                                arrival_time, wire.lora_msg(lora_request)])
            self._adds[request_id] = [accepted, stream, state, arrival_time, None]
            self._outbox.put(("add", body))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    async def sleep(self, level: int = 1) -> None:
        await self._call("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call("wake_up", tags)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return await self._call("add_lora", wire.lora_msg(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._call("remove_lora", lora_id)

    async def pin_lora(self, lora_id: int) -> bool:
        return await self._call("pin_lora", lora_id)

    async def list_loras(self) -> set[int]:
        return set(await self._call("list_loras", None))

    async def _call(self, name: str, arg: Any) -> Any:
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._raise_if_unusable()
            call_id = next(self._call_ids)
            body = wire.encode(["call", call_id, name, arg])
            self._calls[call_id] = done
            self._outbox.put(("call", body))
        return await asyncio.wrap_future(done)

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        self._abort(request_id, error)

    def abort_all(self, error: BaseException | None = None) -> None:
        self._abort(None, error)

    def _abort(self, request_id: str | None, error: BaseException | None) -> None:
        with self._lock:
            if self._fatal is not None or self._stopped:
                return
            ids = list(self._streams) if request_id is None else [request_id]
            for rid in (self._adds if request_id is None else ids):
                if rid in self._adds:  # its "added" is on its way: drop it then
                    self._adds[rid][4] = error or RequestAbortedError(
                        f"request {rid} was aborted")
            ended = [(self._streams.pop(r)[0], r) for r in ids if r in self._streams]
            try:
                self._outbox.put(("abort", wire.encode(["abort", request_id])))
            except InvalidRequestError:  # an id the wire cannot carry was never sent either
                pass
            stats = IterationStats()
            for _, rid in ended:  # under the lock: the reader thread updates it too
                self._tracker.abort(rid, stats)
        for stream, rid in ended:
            stream.put(error or RequestAbortedError(f"request {rid} was aborted"))
        record_stats(self.stat_loggers, stats)

    def check_health(self) -> None:
        self._raise_if_unusable()
        if not self._proc.is_alive():
            raise EngineDeadError(f"the engine core process died (exit code "
                                  f"{self._proc.exitcode})")
        if self._writer_done and not self._stopped:
            raise EngineUnhealthyError("the thread that sends requests to the engine core "
                                       "has stopped (its error is in the log)")

    def check_workers(self, timeout: float = 5.0) -> None:
        """Ask the core's control thread (never queued behind a step): wedged, or a worker
        that does not answer its ping, raises EngineUnhealthyError."""
        with self._control_lock:
            probe_id = next(self._probe_ids)
            reply = self._probe(probe_id, timeout, timeout + 5.0)
        if reply is None:
            raise EngineDeadError("the engine core process is gone")
        if reply[1] is not None:
            raise EngineUnhealthyError(reply[1][1])

    def _probe(self, probe_id: int, timeout: float, wait: float) -> list[Any] | None:
        """Send a health probe and wait up to `wait` s for the reply that carries its id
        (a late reply to an earlier probe that timed out is read and discarded). None when
        the core closed the socket; a timeout is EngineUnhealthyError, not death."""
        try:
            wire.send(self._control, ["health", probe_id, timeout])
        except OSError:
            return None
        deadline = time.monotonic() + wait
        while True:
            for reply in self._control_frames.take():
                if reply[0] == probe_id:
                    return reply
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._control], [], [], left)[0]:
                raise EngineUnhealthyError(f"the engine core did not answer a health probe "
                                           f"within {wait:g} s")
            try:
                chunk = self._control.recv(1 << 16)
            except OSError:
                return None
            if not chunk:
                return None
            self._control_frames.feed(chunk)

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._outbox.put(("stop", wire.encode(["stop"])))
            self._outbox.put(_STOP)
        self._proc.join(timeout)
        if self._proc.is_alive():
            logger.warning("the engine core did not stop within %.0f s; terminating it",
                           timeout)
            self._proc.terminate()
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
        self._end_all(lambda: EngineShutdownError("the engine was shut down"))
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._data.close()
        self._control.close()
        self._interrupts.close()

    # ---------------------------------------------------------------- threads

    def _write(self) -> None:
        """Send what the callers encoded, in order. One message that fails is logged and
        the next one goes on; if this thread ends anyway, check_health says so."""
        try:
            while True:
                msg = self._outbox.get()
                if msg is _STOP:
                    return
                kind, body = msg
                try:
                    wire.send_encoded(self._data, body)
                    if kind == "abort" and \
                            self.config.scheduler_config.num_scheduler_steps > 1:
                        self._interrupts.send(b"!", socket.MSG_DONTWAIT)
                except BlockingIOError:
                    pass  # interrupts already waiting to be read: one more adds nothing
                except OSError:
                    return  # the core is gone: the reader reports it
                except Exception:  # noqa: BLE001 - one message, never the thread
                    logger.exception("could not send a %r message to the engine core", kind)
        finally:
            self._writer_done = True

    def _read(self) -> None:
        while True:
            msg = wire.recv(self._data)
            if msg is None or msg[0] == "dead":
                self._die(msg)
                return
            kind = msg[0]
            if kind == "out":
                self._deliver(msg[1], msg[2])
            elif kind == "added":
                self._added(msg[1], msg[2])
            elif kind == "called":
                with self._lock:
                    done = self._calls.pop(msg[1], None)
                self._sleeping = msg[3]
                if done is not None:
                    _settle(done, error=None if msg[2] is None else wire.load_error(msg[2]),
                            result=msg[4])

    def _added(self, request_id: str, error: list[str] | None) -> None:
        with self._lock:
            accepted, stream, state, arrival, aborted = self._adds.pop(request_id)
            if error is None and aborted is None:
                self._streams[request_id] = (stream, state)
                self._tracker.add(request_id, arrival)
        _settle(accepted, error=None if error is None else wire.load_error(error))
        if error is None and aborted is not None:
            # Accepted, then aborted by the abort queued behind it (the core dropped it):
            # the stream ends with the abort's error, as the in-process engine's does.
            stream.put(aborted)

    def _deliver(self, load: list[Any], deltas: list[Any]) -> None:
        now = time.time()
        stats = IterationStats()
        deliveries = []
        with self._lock:
            for delta in deltas:
                entry = self._streams.get(delta[0])
                if entry is None:  # aborted meanwhile
                    continue
                out = entry[1].apply(delta)
                self._tracker.observe(out, now, stats)
                if out.finished:
                    del self._streams[delta[0]]
                deliveries.append((entry[0], out))
        self.load = EngineLoad(*load)
        record_stats(self.stat_loggers, stats)
        deliver_threadsafe(deliveries)

    def _die(self, msg: list[Any] | None) -> None:
        if msg is None:
            if self._stopped:
                return
            self._proc.join(1.0)
            cause: BaseException = EngineDeadError(
                f"the engine core process died unexpectedly (exit code {self._proc.exitcode})")
        else:
            cause = wire.load_error(msg[1])
        logger.error("engine core died: %s", cause)
        with self._lock:
            self._fatal = cause
            adds, self._adds = list(self._adds.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for accepted, *_ in adds:
            _settle(accepted, error=_dead(cause))
        for done in calls:
            _settle(done, error=_dead(cause))
        self._end_all(lambda: _dead(cause))

    def _end_all(self, make_error: Any) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream, _ in streams:
            stream.put(make_error())


def _prompt_parts(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of a prompt, either None when absent; anything else is sent as no
    prompt at all, for the core's engine to reject with its message."""
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        return prompt.get("prompt"), None if ids is None else list(ids)
    if isinstance(prompt, list):
        return None, list(prompt)
    return (prompt if isinstance(prompt, str) else None), None
