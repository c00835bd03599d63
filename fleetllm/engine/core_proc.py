"""The engine-core process: an LLMEngine stepping in a busy loop in a process of its own, so
the API process's HTTP, JSON and tokenization never hold the GIL the engine needs.

How: core_client starts it (spawn) with three AF_UNIX socket pairs (core_wire). The main
thread applies the waiting messages in order, at most APPLY_BURST (about APPLY_BURST_S) before
each step, steps and sends the deltas; idle, it probes the workers. A control thread answers
health probes beside a step; an interrupt thread ends a multi-step call on an abort.
Failures: workers are the LLMEngine's to replace. An exception escaping the loop sends
["dead", error] and exits 1. EOF from the API process (ParentWatch while the engine is built)
shuts the workers down and exits; every way out shuts the engine down. SIGINT and SIGTERM are
ignored: the API process owns the lifecycle and stops the core in order.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import logging
import os
import select
import signal
import socket
import threading
import time
from typing import Any

from fleetllm.engine import core_wire as wire
from fleetllm.engine.async_front import EngineUnhealthyError, raise_if_wedged
from fleetllm.engine.llm_engine import LLMEngine
from fleetllm.engine.recovery import resume_samples
from fleetllm.engine.stats import EngineLoad
from fleetllm.errors import EngineSleepingError

logger = logging.getLogger(__name__)
# Messages applied between two steps at most (and about this many seconds of them): a burst
# of adds is spread over steps instead of stalling the requests already running.
APPLY_BURST = 256
APPLY_BURST_S = 0.02
PARENT_POLL_S = 0.25
ORPHAN_EXIT_S = 20.0


def run_engine_core(model: str, engine_kwargs: dict[str, Any], data: socket.socket,
                    control: socket.socket, interrupts: socket.socket, step_timeout_s: float,
                    health_probe_interval_s: float, log_level: int) -> None:
    """The process's target. Every way out shuts the engine's workers down (finally), and
    an API process that goes away while the engine is still being built stops the build
    (ParentWatch): nothing is left running under pid 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    watch = ParentWatch()
    engine: LLMEngine | None = None
    code = 1
    try:
        try:
            engine = LLMEngine.from_engine_args(model, **engine_kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to the API process, which raises it
            if not watch.orphaned:
                with contextlib.suppress(OSError):
                    wire.send(data, ["dead", wire.error_msg(e)])
            return
        if watch.stop():
            return
        core = EngineCore(engine, data, step_timeout_s, health_probe_interval_s)
        threading.Thread(target=core.serve_control, args=(control,),
                         name="fleetllm-core-control", daemon=True).start()
        threading.Thread(target=core.serve_interrupts, args=(interrupts,),
                         name="fleetllm-core-interrupts", daemon=True).start()
        try:
            wire.send(data, ["ready"])
        except OSError:  # the API process is gone
            return
        code = core.run()
    finally:
        watch.stop()
        if engine is not None:
            engine.shutdown()
        logging.shutdown()
        raise SystemExit(code)


class ParentWatch:
    """While the engine is being built (minutes, for a big checkpoint), nobody reads the data
    socket: a thread checks every PARENT_POLL_S that the API process still exists, and if it
    went away (SIGKILL, or SIGTERM before it could stop the core) interrupts the build in the
    main thread (KeyboardInterrupt: LLMEngine shuts down what it started), then exits the
    process if the build does not unwind within ORPHAN_EXIT_S (stuck in a C call)."""

    def __init__(self) -> None:
        self.parent = os.getppid()
        self.orphaned = False
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="fleetllm-core-parent-watch",
                         daemon=True).start()

    def stop(self) -> bool:
        """Stop watching (the engine is built); True if the parent is already gone."""
        self._done.set()
        return self.orphaned or os.getppid() != self.parent

    def _watch(self) -> None:
        while not self._done.wait(PARENT_POLL_S):
            if os.getppid() != self.parent:
                self.orphaned = True
                logger.warning("the API process went away while the engine was starting: "
                               "stopping")
                _thread.interrupt_main()
                if not self._done.wait(ORPHAN_EXIT_S):
                    os._exit(1)
                return


class EngineCore:
    def __init__(self, engine: LLMEngine, data: socket.socket, step_timeout_s: float,
                 health_probe_interval_s: float):
        self.engine = engine
        self.step_timeout_s = step_timeout_s
        self.health_probe_interval_s = health_probe_interval_s
        self.data = data  # blocking for sends: the API process's reader always drains it
        self.reader = wire.FrameReader()
        self.deltas = wire.DeltaEncoder()
        self.live: set[str] = set()  # requests added and not yet finished or aborted
        self.busy_since: float | None = None  # monotonic start of the engine call under way
        self.fatal: BaseException | None = None
        self.pending: collections.deque[Any] = collections.deque()  # read, not yet applied

    # ------------------------------------------------------------ the main loop

    def run(self) -> int:
        """0 when told to stop or when the API process went away, 1 after a fatal error."""
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                received = self._receive(
                    self.health_probe_interval_s if idle and not self.pending else 0.0)
                if received is None:
                    return 0
                self.pending.extend(received)
                if not self.pending and idle:
                    self._busy(self.engine.check_health)  # a dead worker is replaced now
                    # worker_restarts may have moved
                    wire.send(self.data, ["out", self._load(), []])
                # At most one burst of messages, then a step: a client that sends 200,000
                # adds at once does not hold every other request's next token for their
                # whole burst (order is kept: the rest wait in self.pending).
                applied = self._apply_burst()
                if applied is None:
                    return 0
                if self.engine.has_unfinished_requests():
                    self._step()
                elif applied:  # e.g. the last request aborted: /metrics sees it freed
                    wire.send(self.data, ["out", self._load(), []])
        except BaseException as e:  # noqa: BLE001 - anything from the engine is fatal
            self.fatal = e
            logger.error("engine core died: %s", e, exc_info=e)
            try:
                wire.send(self.data, ["dead", wire.error_msg(e)])
            except OSError:
                pass
            return 1

    def _apply_burst(self) -> int | None:
        """Apply the oldest pending messages: up to APPLY_BURST of them, for about
        APPLY_BURST_S at most (adds are checked and tokenized here). How many; None on
        "stop"."""
        deadline = time.monotonic() + APPLY_BURST_S
        applied = 0
        while self.pending and applied < APPLY_BURST:
            msg = self.pending.popleft()
            if msg[0] == "stop":
                return None
            self._apply(msg)
            applied += 1
            if time.monotonic() > deadline:
                break
        return applied

    def _receive(self, timeout: float) -> list[Any] | None:
        """Every whole message waiting (waiting up to `timeout` for the first); None at EOF."""
        ready, _, _ = select.select([self.data], [], [], timeout)
        messages: list[Any] = []
        while ready:
            try:
                chunk = self.data.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError:
                return None
            if not chunk:
                return None
            messages += self.reader.feed(chunk)
        return messages

    def _apply(self, msg: list[Any]) -> None:
        kind = msg[0]
        if kind in ("add", "resume"):
            _, request_id, text, token_ids, params, arrival, lora = msg[:7]
            error = None
            try:
                if self.engine.model_executor.is_sleeping:
                    raise EngineSleepingError(
                        "the engine is asleep: wake it up (POST /wake_up) first")
                prompt = {k: v for k, v in (("prompt", text), ("prompt_token_ids", token_ids))
                          if v is not None}
                self._busy(self.engine.add_request, request_id, prompt,
                           wire.load_params(params), arrival, wire.load_lora(lora))
                if kind == "resume":  # a dead core's request: it goes on from its tokens
                    self._resume(request_id, msg[7])
                self.live.add(request_id)
            except Exception as e:  # a rejected request: it queued nothing
                error = wire.error_msg(e)
            wire.send(self.data, ["added", request_id, error])
        elif kind == "abort":
            ids = list(self.live) if msg[1] is None else [msg[1]]
            for request_id in ids:
                if request_id in self.live:
                    self.live.discard(request_id)
                    self.deltas.forget(request_id)
                    self._busy(self.engine.abort_request, request_id)
        elif kind == "call":
            _, call_id, name, arg = msg
            error = result = None
            try:
                result = self._busy(self._call, name, arg)
            except Exception as e:  # refused (e.g. sleep with requests in flight)
                error = wire.error_msg(e)
            wire.send(self.data, ["called", call_id, error,
                                  self.engine.model_executor.is_sleeping, result])

    def _resume(self, request_id: str, samples: list[list[Any]]) -> None:
        try:
            resume_samples(self.engine, request_id, samples)
        except BaseException:
            self.engine.abort_request(request_id)
            raise
        # The API process has these: only what follows them is sent.
        self.deltas.resumed(request_id, {index: (len(text), len(tokens))
                                         for index, tokens, text, *_ in samples})

    def _call(self, name: str, arg: Any) -> Any:
        """A call's result, as plain data for the wire."""
        if name == "sleep":
            return self.engine.sleep(arg)
        if name == "wake_up":
            return self.engine.wake_up(arg)
        if name == "add_lora":
            return bool(self.engine.add_lora(wire.load_lora(arg)))
        if name in ("remove_lora", "pin_lora"):
            return bool(getattr(self.engine, name)(int(arg)))
        if name == "list_loras":
            return sorted(self.engine.list_loras())
        raise ValueError(f"unknown call {name!r}")

    def _step(self) -> None:
        outputs = self._busy(self.engine.step)
        deltas = []
        for out in outputs:
            if out.request_id not in self.live:
                continue  # aborted meanwhile
            deltas.append(self.deltas.encode(out))
            if out.finished:
                self.live.discard(out.request_id)
        wire.send(self.data, ["out", self._load(), deltas])

    def _busy(self, fn: Any, *args: Any) -> Any:
        self.busy_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.busy_since = None

    def _load(self) -> list[Any]:
        return wire.load_msg(EngineLoad.of(self.engine))

    # ------------------------------------------------------------ the control thread

    def serve_control(self, control: socket.socket) -> None:
        while True:
            msg = wire.recv(control)
            if msg is None:
                return
            _, probe_id, timeout = msg
            try:
                self._check_health(float(timeout))
                reply = None
            except Exception as e:
                reply = wire.error_msg(e)
            try:
                wire.send(control, [probe_id, reply])
            except OSError:
                return

    def serve_interrupts(self, interrupts: socket.socket) -> None:
        """An abort was sent: end a multi-step call under way now (LLMEngine.interrupt_step)
        instead of after its k passes; the abort is applied once the step returns."""
        while True:
            try:
                if not interrupts.recv(64):
                    return
            except OSError:
                return
            self.engine.interrupt_step()

    def _check_health(self, timeout: float) -> None:
        if self.fatal is not None:
            raise EngineUnhealthyError(f"the engine died: {self.fatal}")
        raise_if_wedged(self.busy_since, self.step_timeout_s)
        if not self.engine.model_executor.is_sleeping:
            self.engine.model_executor.check_health(timeout)
