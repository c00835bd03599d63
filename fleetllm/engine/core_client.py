"""EngineCoreClient: AsyncLLMEngine's API with the engine in its own process (core_proc).

The API process keeps streams, tokenization, request statistics and the load snapshot. A
writer thread sends the callers' encoded commands (an event loop never blocks on a socket);
a reader thread turns each step's deltas into outputs (core_wire.RequestState, PoolingState)
and hands them to their streams, one wake-up per event loop per step.
Failures: if the core process dies (EOF on the data socket) the reader starts a new one
(core_restart: within max_worker_restarts per worker_restart_window_s) and every request in
flight resumes from the tokens its stream has: no gap, no duplicate. Past the limit, or on
the core's own fatal error, every stream, add and call raises EngineDeadError, later calls
fail fast and `on_dead` is called (the server exits 1). shutdown() stops, then kills the core.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from fleetllm.config import EngineConfig
from fleetllm.engine import core_wire as wire
from fleetllm.engine.async_front import (
    AsyncEngineFront,
    EngineDeadError,
    EngineUnhealthyError,
    RequestAbortedError,
    dead_error,
    settle,
)
from fleetllm.engine.async_stream import RequestStream, deliver_threadsafe
from fleetllm.engine.core_restart import CoreRestartMixin, Restore, probe, start_core
from fleetllm.engine.llm_engine import PromptType
from fleetllm.engine.recovery import RestartBudget
from fleetllm.engine.stats import (
    EngineLoad,
    IterationStats,
    RequestStatsTracker,
    StatLogger,
    record_stats,
)
from fleetllm.engine.tokenizer import load_tokenizer
from fleetllm.errors import EngineShutdownError, InvalidRequestError
from fleetllm.lora.request import LoRARequest
from fleetllm.pooling_params import PoolingParams
from fleetllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_STOP = object()
_WORKER_RESTARTS = [f.name for f in dataclasses.fields(EngineLoad)].index("worker_restarts")


class EngineCoreClient(CoreRestartMixin, AsyncEngineFront):
    def __init__(self, model: str, *, step_timeout_s: float = 60.0,
                 health_probe_interval_s: float = 5.0,
                 stat_loggers: list[StatLogger] | None = None,
                 max_core_restarts: float | None = None, **engine_kwargs: Any):
        """max_core_restarts: new cores started after the core process died, within the
        engine's worker_restart_window_s (default: its max_worker_restarts)."""
        self.config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
        self.model_config = self.config.model_config
        self.step_timeout_s = step_timeout_s
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.load = EngineLoad()
        pc = self.config.parallel_config
        self.core_restarts = RestartBudget(
            pc.max_worker_restarts if max_core_restarts is None else max_core_restarts,
            pc.worker_restart_window_s)
        # Called (on the reader thread) once the engine is dead for good: `fleetllm serve`
        # exits non-zero then, for a supervisor to restart it.
        self.on_dead: Callable[[BaseException], None] | None = None
        self._start_args = (model, engine_kwargs, step_timeout_s, health_probe_interval_s)
        self.tokenizer = load_tokenizer(self.model_config.tokenizer)
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="fleetllm-tokenizer")
        self._lock = threading.Lock()
        self._fatal: BaseException | None = None
        self._stopped = False
        self._sleeping = False
        self._restarting = False
        self._streams: dict[str, tuple[RequestStream,
                                       wire.RequestState | wire.PoolingState]] = {}
        # request id -> [accepted, stream, state, arrival time, the error its stream ends with
        # when it was aborted before it was accepted (else None)]
        self._adds: dict[str, list[Any]] = {}
        # call id -> (its future, its message: sent again to a new core)
        self._calls: dict[int, tuple[concurrent.futures.Future, bytes]] = {}
        self._call_ids = itertools.count()
        self._restore = Restore()
        self._tracker = RequestStatsTracker()
        # (generation, kind, body): a message queued for a core that has died since is
        # dropped (the restart sends what the new core needs).
        self._outbox: queue.Queue[Any] = queue.Queue()
        self._gen = 0
        self._send_lock = threading.Lock()  # the generation and the sockets, for the writer
        self._control_lock = threading.Lock()
        self._probe_ids = itertools.count()
        self._writer_done = False
        self._worker_restarts_before = 0  # the dead cores' worker restarts (metrics)
        try:
            self._core = start_core(*self._start_args)
        except BaseException:
            self._tokenizer_pool.shutdown(wait=False)
            raise
        self._control_frames = wire.FrameBuffer()
        self._reader = threading.Thread(target=self._read, name="fleetllm-core-reader",
                                        daemon=True)
        self._writer = threading.Thread(target=self._write, name="fleetllm-core-writer",
                                        daemon=True)
        self._reader.start()
        self._writer.start()

    @property
    def _proc(self) -> Any:
        return self._core.proc

    # ---------------------------------------------------------------- caller side

    async def add_request(self, request_id: str, prompt: PromptType,
                          params: SamplingParams | PoolingParams | None = None,
                          arrival_time: float | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        arrival_time = arrival_time or time.time()
        params = params if params is not None else SamplingParams()
        self._raise_if_unusable()
        prompt = await self._tokenized(prompt)
        text, token_ids = wire.prompt_parts(prompt)
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
            state.add = [request_id, text, token_ids, wire.params_msg(params), arrival_time,
                         wire.lora_msg(lora_request)]
            body = wire.encode(["add", *state.add])
            self._adds[request_id] = [accepted, stream, state, arrival_time, None]
            self._put("add", body)
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
        self._restore.sleep_level = level  # a new core is put to sleep too

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call("wake_up", tags)
        if not self._sleeping:  # all of it awake (tags may wake a part only)
            self._restore.sleep_level = None

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        msg = wire.lora_msg(lora_request)
        added = await self._call("add_lora", msg)
        self._restore.loras[lora_request.lora_int_id] = msg  # a new core loads it again
        return added

    async def remove_lora(self, lora_id: int) -> bool:
        removed = await self._call("remove_lora", lora_id)
        self._restore.loras.pop(lora_id, None)
        self._restore.pinned.discard(lora_id)
        return removed

    async def pin_lora(self, lora_id: int) -> bool:
        pinned = await self._call("pin_lora", lora_id)
        if pinned:
            self._restore.pinned.add(lora_id)
        return pinned

    async def list_loras(self) -> set[int]:
        return set(await self._call("list_loras", None))

    async def _call(self, name: str, arg: Any) -> Any:
        with self._lock:
            self._raise_if_unusable()
            done = self._queue_call(name, arg)
        return await asyncio.wrap_future(done)

    def _queue_call(self, name: str, arg: Any) -> concurrent.futures.Future:
        """Under the lock."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        body = wire.encode(["call", call_id, name, arg])
        self._calls[call_id] = (done, body)
        self._put("call", body)
        return done

    def _put(self, kind: str, body: bytes) -> None:
        """Under the lock: for the current core."""
        self._outbox.put((self._gen, kind, body))

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
                self._put("abort", wire.encode(["abort", request_id]))
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
        if self._restarting or not self._proc.is_alive():
            raise EngineUnhealthyError("the engine core process died; a new one is starting "
                                       "(requests in flight resume when it is up)")
        if self._writer_done and not self._stopped:
            raise EngineUnhealthyError("the thread that sends requests to the engine core "
                                       "has stopped (its error is in the log)")

    def check_workers(self, timeout: float = 5.0) -> None:
        """Ask the core's control thread (never queued behind a step): wedged, or a worker
        that does not answer its ping, raises EngineUnhealthyError."""
        with self._control_lock:
            gen = self._gen
            probe_id = next(self._probe_ids)
            reply = probe(self._core.control, self._control_frames, probe_id, timeout,
                          timeout + 5.0)
        if reply is None:
            self._raise_if_unusable()
            if self._restarting or gen != self._gen or not self._stopped:
                raise EngineUnhealthyError("the engine core process died; a new one is "
                                           "starting")
            raise EngineDeadError("the engine core process is gone")
        if reply[1] is not None:
            raise EngineUnhealthyError(reply[1][1])

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._put("stop", wire.encode(["stop"]))
            self._outbox.put(_STOP)
        if self._writer_done:  # no thread left to send the stop: the core would wait `timeout`
            with self._send_lock:
                try:
                    wire.send_encoded(self._core.data, wire.encode(["stop"]))
                except OSError:
                    pass  # the core is gone already
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
        self._core.close()

    # ---------------------------------------------------------------- threads

    def _write(self) -> None:
        """Send what the callers encoded, in order. One message that fails is logged and
        the next one goes on; if this thread ends anyway, check_health says so."""
        try:
            while True:
                msg = self._outbox.get()
                if msg is _STOP:
                    return
                gen, kind, body = msg
                with self._send_lock:
                    if gen != self._gen:
                        continue  # for a core that died: the restart sent what is needed
                    core = self._core
                try:
                    wire.send_encoded(core.data, body)
                    if kind == "abort" and \
                            self.config.scheduler_config.num_scheduler_steps > 1:
                        core.interrupts.send(b"!", socket.MSG_DONTWAIT)
                except BlockingIOError:
                    pass  # interrupts already waiting to be read: one more adds nothing
                except OSError:
                    pass  # the core is gone: the reader restarts it (or reports it)
                except Exception:  # noqa: BLE001 - one message, never the thread
                    logger.exception("could not send a %r message to the engine core", kind)
        finally:
            self._writer_done = True

    def _read(self) -> None:
        while True:
            msg = wire.recv(self._core.data)
            if msg is None and not self._stopped and self._restart():
                continue  # a new core runs every request in flight
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
                    done, _ = self._calls.pop(msg[1], (None, None))
                self._sleeping = msg[3]
                if done is not None:
                    settle(done, error=None if msg[2] is None else wire.load_error(msg[2]),
                            result=msg[4])

    def _added(self, request_id: str, error: list[str] | None) -> None:
        with self._lock:
            entry = self._adds.pop(request_id, None)
            if entry is None:  # a resumed request: a new core refused to take it on
                ended = self._streams.pop(request_id, None) if error is not None else None
                stats = IterationStats()
                if ended is not None:
                    self._tracker.abort(request_id, stats)
            else:
                accepted, stream, state, arrival, aborted = entry
            if entry is not None and error is None and aborted is None:
                self._streams[request_id] = (stream, state)
                self._tracker.add(request_id, arrival)
        if entry is None:
            if ended is not None:
                ended[0].put(wire.load_error(error))
                record_stats(self.stat_loggers, stats)
            return
        settle(accepted, error=None if error is None else wire.load_error(error))
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
        self.load = dataclasses.replace(
            EngineLoad(*load), engine_core_restarts=self.core_restarts.total,
            worker_restarts=load[_WORKER_RESTARTS] + self._worker_restarts_before)
        record_stats(self.stat_loggers, stats)
        deliver_threadsafe(deliveries)

    def _die(self, msg: list[Any] | None) -> None:
        if msg is None:
            if self._stopped:
                return
            self._proc.join(1.0)
            cause: BaseException = EngineDeadError(
                f"the engine core process died unexpectedly (exit code {self._proc.exitcode})"
                f" and could not be restarted (max_worker_restarts)")
        else:
            cause = wire.load_error(msg[1])
        logger.error("engine core died: %s", cause)
        with self._lock:
            self._fatal = cause
            adds, self._adds = list(self._adds.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for accepted, *_ in adds:
            settle(accepted, error=dead_error(cause))
        for done, _ in calls:
            settle(done, error=dead_error(cause))
        self._end_all(lambda: dead_error(cause))
        if self.on_dead is not None:
            self.on_dead(cause)

    def _end_all(self, make_error: Any) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream, _ in streams:
            stream.put(make_error())

