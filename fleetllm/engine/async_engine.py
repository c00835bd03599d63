"""AsyncLLMEngine: one background thread steps an LLMEngine; many asyncio callers stream.

How: only the engine loop thread touches the (not thread-safe) LLMEngine; callers enqueue
add/abort/stop commands applied between steps and read a RequestStream fed through
`call_soon_threadsafe` (async_front.AsyncEngineFront has the caller side both fronts share).
generate() yields cumulative RequestOutputs with `delta_*` fields (a slow consumer's
outputs merge); text within len(longest stop) - 1 of a stop string is held back until the
request finishes. encode() is its twin for pooling requests (one finished output).
What fails: crashed or hung workers are replaced by the engine and requests resume; anything
that escapes that is fatal: every open stream and queued call raises EngineDeadError (cause
chained), later calls at once. Closing a stream aborts its request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleetllm.engine.async_front import (
    AsyncEngineFront,
    EngineDeadError,
    EngineUnhealthyError,
    RequestAbortedError,
    dead_error,
    raise_if_wedged,
    settle,
)
from fleetllm.engine.async_stream import (
    RequestStream,
    StreamingCompletionOutput,
    deliver_threadsafe,
)
from fleetllm.engine.llm_engine import LLMEngine, PromptType
from fleetllm.engine.stats import (
    EngineLoad,
    IterationStats,
    RequestStatsTracker,
    StatLogger,
    record_stats,
)
from fleetllm.engine.tokenizer import load_tokenizer
from fleetllm.errors import EngineShutdownError, EngineSleepingError
from fleetllm.lora.request import LoRARequest
from fleetllm.pooling_params import PoolingParams
from fleetllm.sampling_params import SamplingParams

# The errors and raise_if_wedged live in async_front.py; this is their old import path too.
__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineUnhealthyError", "RequestAbortedError",
           "RequestStream", "StreamingCompletionOutput", "raise_if_wedged"]

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams
    arrival_time: float
    stream: RequestStream
    accepted: concurrent.futures.Future
    lora_request: LoRARequest | None = None


@dataclass
class _Abort:
    request_id: str | None  # None: every request
    error: BaseException | None


@dataclass
class _Call:
    """Run fn on the loop thread between steps (sleep, wake_up): LLMEngine is not thread-safe."""

    fn: Callable[[], Any]
    done: concurrent.futures.Future


_STOP = object()


class AsyncLLMEngine(AsyncEngineFront):
    def __init__(self, engine: LLMEngine, *, step_timeout_s: float = 60.0,
                 health_probe_interval_s: float = 5.0,
                 stat_loggers: list[StatLogger] | None = None):
        self.engine = engine
        self.config = engine.config
        self.model_config = engine.model_config
        # No engine call (a step, an add) may take longer than this while the engine is
        # healthy: past it, check_health reports the engine wedged.
        self.step_timeout_s = step_timeout_s
        self.health_probe_interval_s = health_probe_interval_s
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.load = EngineLoad()
        # The front's own tokenizer: the engine's is used by the loop thread (detokenizing).
        self.tokenizer = load_tokenizer(engine.model_config.tokenizer)
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="fleetllm-tokenizer")
        self._commands: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()  # orders the dead/stopped checks against enqueueing
        self._fatal: BaseException | None = None
        # Called (on the loop thread) once the engine is dead for good: `fleetllm serve`
        # exits non-zero then, for a supervisor to restart it.
        self.on_dead: Callable[[BaseException], None] | None = None
        self._stopped = False
        self._busy_since: float | None = None  # monotonic start of the engine call under way
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._tracker = RequestStatsTracker()
        self._publish(IterationStats())
        self._thread = threading.Thread(target=self._run, name="fleetllm-engine-loop",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, model: str, *, step_timeout_s: float = 60.0,
                         health_probe_interval_s: float = 5.0,
                         stat_loggers: list[StatLogger] | None = None,
                         **engine_kwargs: Any) -> AsyncLLMEngine:
        """The engine on a thread of this process. core_client.EngineCoreClient(model,
        ...) has the same API with the engine in a process of its own (`fleetllm serve`)."""
        return cls(LLMEngine.from_engine_args(str(model), **engine_kwargs),
                   step_timeout_s=step_timeout_s,
                   health_probe_interval_s=health_probe_interval_s, stat_loggers=stat_loggers)

    # ---------------------------------------------------------------- caller side

    async def add_request(self, request_id: str, prompt: PromptType,
                          params: SamplingParams | PoolingParams | None = None,
                          arrival_time: float | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request (SamplingParams: generate; PoolingParams: pool; None: default
        SamplingParams), through `lora_request`'s adapter when given, and wait until the
        engine has accepted it (or rejected it: raises; a LoRA request without enable_lora
        is an InvalidRequestError). The caller must iterate the stream to its end or
        close() it."""
        arrival_time = arrival_time or time.time()
        params = params if params is not None else SamplingParams()
        self._raise_if_unusable()
        prompt = await self._tokenized(prompt)
        stream = RequestStream(request_id, self)
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._enqueue(_Add(request_id, prompt, params, arrival_time, stream, accepted,
                           lora_request))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add: it never outlives its caller
            raise
        return stream

    @property
    def is_sleeping(self) -> bool:
        return self.engine.model_executor.is_sleeping

    async def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and the weights (level 2); refused (EngineSleepingError)
        while requests are in flight. New requests fail with EngineSleepingError until
        wake_up."""
        await self._call(lambda: self.engine.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call(lambda: self.engine.wake_up(tags))

    # LoRA adapters (vLLM's names): run on the loop thread between steps, as sleep does.
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load the adapter now (a bad one raises here, before any request uses it)."""
        return await self._call(lambda: self.engine.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._call(lambda: self.engine.remove_lora(lora_id))

    async def pin_lora(self, lora_id: int) -> bool:
        return await self._call(lambda: self.engine.pin_lora(lora_id))

    async def list_loras(self) -> set[int]:
        return set(await self._call(self.engine.list_loras))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._enqueue(_Call(fn, done))
        return await asyncio.wrap_future(done)

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Abort a request (all its sequences) before the next step. Its stream, if anyone
        still reads it, raises `error` (default RequestAbortedError). A multi-step call under
        way ends after its current pass (LLMEngine.interrupt_step)."""
        self._enqueue(_Abort(request_id, error), quiet=True)
        self.engine.interrupt_step()

    def abort_all(self, error: BaseException | None = None) -> None:
        self._enqueue(_Abort(None, error), quiet=True)
        self.engine.interrupt_step()

    def check_health(self) -> None:
        """Raise EngineUnhealthyError (EngineDeadError, ...) unless the engine can serve."""
        self._raise_if_unusable()
        if not self._thread.is_alive():
            raise EngineDeadError("the engine loop thread is gone")
        raise_if_wedged(self._busy_since, self.step_timeout_s)

    def check_workers(self, timeout: float = 5.0) -> None:
        """Executor.check_health: every worker answers a timed ping, never queued behind a
        step (blocking: call it from a thread, not the event loop)."""
        if not self.is_sleeping:
            self.engine.model_executor.check_health(timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop (open streams raise EngineShutdownError), then the executor."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._commands.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine loop did not stop within %.0f s; stopping the "
                           "executor under it", timeout)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()

    def _enqueue(self, command: Any, quiet: bool = False) -> None:
        with self._lock:
            if self._fatal is not None or self._stopped:
                if quiet:
                    return
                self._raise_if_unusable()
            self._commands.put(command)

    # ---------------------------------------------------------------- the loop thread

    def _run(self) -> None:
        try:
            while self._apply_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:  # noqa: BLE001 - anything from the engine is fatal
            self._die(e)
            return
        self._end_all(lambda: EngineShutdownError("the engine was shut down"))

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command; False once asked to stop."""
        try:
            command = self._commands.get(timeout=self.health_probe_interval_s) if block \
                else self._commands.get_nowait()
        except queue.Empty:
            # Idle (or asleep): a dead worker must not pass as healthy, and is replaced as a
            # failed step's would be (LLMEngine.check_health); only past max_worker_restarts
            # does the engine die.
            if block:
                self._busy(self.engine.check_health)
                self._publish(IterationStats())  # worker_restarts may have moved
            return True
        stats = IterationStats()
        while command is not _STOP:
            if isinstance(command, _Add):
                self._busy(self._add, command)
            elif isinstance(command, _Call):
                try:
                    settle(command.done, result=self._busy(command.fn))
                except Exception as e:  # refused (e.g. sleep with requests in flight)
                    settle(command.done, error=e)
            elif command.request_id is None:
                for request_id in list(self._streams):
                    self._busy(self._abort, request_id, command.error, stats)
            else:
                self._busy(self._abort, command.request_id, command.error, stats)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._publish(stats)
                return True
        return False

    def _busy(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._busy_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._busy_since = None

    def _add(self, cmd: _Add) -> None:
        if cmd.accepted.cancelled():  # the caller went away before it was queued
            return
        if self.is_sleeping:
            settle(cmd.accepted, error=EngineSleepingError(
                "the engine is asleep: wake it up (POST /wake_up) first"))
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.arrival_time,
                                    cmd.lora_request)
        except Exception as e:  # a rejected request: it queued nothing, others are unharmed
            settle(cmd.accepted, error=e)
            return
        self._streams[cmd.request_id] = cmd.stream
        self._tracker.add(cmd.request_id, cmd.arrival_time)
        settle(cmd.accepted)

    def _abort(self, request_id: str, error: BaseException | None,
               stats: IterationStats) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:  # finished, rejected or already aborted
            return
        self.engine.abort_request(request_id)
        self._tracker.abort(request_id, stats)
        stream.put(error or RequestAbortedError(f"request {request_id} was aborted"))

    def _step(self) -> None:
        outputs = self._busy(self.engine.step)
        now = time.time()
        stats = IterationStats()
        deliveries: list[tuple[RequestStream, Any]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile: its consumer is gone
                continue
            self._tracker.observe(out, now, stats)
            if out.finished:
                del self._streams[out.request_id]
            deliveries.append((stream, out))
        # Metrics first: a client that has its last token has it counted too.
        self._publish(stats)
        deliver_threadsafe(deliveries)

    def _publish(self, stats: IterationStats) -> None:
        self.load = EngineLoad.of(self.engine)
        record_stats(self.stat_loggers, stats)

    def _die(self, error: BaseException) -> None:
        logger.error("engine loop died: %s", error, exc_info=error)
        with self._lock:
            self._fatal = error
        while True:  # nothing is queued after _fatal is set: settle what is there
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                settle(command.accepted, error=dead_error(error))
            elif isinstance(command, _Call):  # a sleep or wake_up waiting its turn
                settle(command.done, error=dead_error(error))
        self._end_all(lambda: dead_error(error))
        if self.on_dead is not None:
            self.on_dead(error)

    def _end_all(self, make_error: Callable[[], BaseException]) -> None:
        for stream in self._streams.values():
            stream.put(make_error())
        self._streams.clear()
