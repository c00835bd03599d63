"""Starting and restarting engine-core processes (core_proc) for core_client.

start_core() spawns a core with its three socket pairs and waits for its "ready". It raises
the core's own error, EngineDeadError when the process exits or is silent for START_TIMEOUT_S,
or whatever interrupts the wait (a signal's SystemExit); in every case the process is killed
and reaped and the sockets closed first, so a failed start leaves nothing running.
CoreRestartMixin: when the core died, start a new one within core_restarts (a failed start
counts, and is tried again after a short pause) and send it, before anything queued later,
the LoRA adapters (Restore), every request in flight as a "resume", the waiting adds and
calls, and sleep; messages queued for the dead core are dropped by generation (the writer
compares). probe(): a health probe on the control socket that reads past stale replies.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from fleetllm.engine import core_wire as wire
from fleetllm.engine.async_front import EngineDeadError, EngineUnhealthyError, settle
from fleetllm.engine.async_stream import RequestStream
from fleetllm.engine.core_proc import run_engine_core
from fleetllm.errors import InvalidRequestError
from fleetllm.executor.multiproc import _main_not_reimported

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0  # loading a big checkpoint is slow; a dead core is seen at once


@dataclass
class CoreHandle:
    proc: Any  # multiprocessing.Process
    data: socket.socket
    control: socket.socket
    interrupts: socket.socket

    def close(self) -> None:
        for sock in (self.data, self.control, self.interrupts):
            with contextlib.suppress(OSError):
                sock.close()

    def reap(self, timeout: float = 5.0) -> None:
        """Make sure the process is gone (killed if still alive) and reaped."""
        self.proc.join(timeout if not self.proc.is_alive() else 0.1)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout)


def start_core(model: str, engine_kwargs: dict[str, Any], step_timeout_s: float,
               health_probe_interval_s: float) -> CoreHandle:
    data, core_data = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    control, core_control = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    # One byte per abort: the core's interrupt thread ends a multi-step call under way
    # (the abort itself is read between steps, from the data socket).
    interrupts, core_interrupts = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = multiprocessing.get_context("spawn").Process(
        target=run_engine_core, name="fleetllm-engine-core",
        args=(model, engine_kwargs, core_data, core_control, core_interrupts,
              step_timeout_s, health_probe_interval_s,
              logging.getLogger().getEffectiveLevel()))
    handle = CoreHandle(proc, data, control, interrupts)
    ready = False
    try:
        with _main_not_reimported():
            proc.start()
        for sock in (core_data, core_control, core_interrupts):
            sock.close()
        error = _await_ready(handle)
        if error is not None:
            raise error
        ready = True
        return handle
    finally:
        if not ready:  # an error, or a signal while waiting: nothing is left running
            for sock in (core_data, core_control, core_interrupts):
                sock.close()
            if proc.pid is not None:
                handle.reap()
            handle.close()


def _await_ready(handle: CoreHandle) -> BaseException | None:
    handle.data.settimeout(START_TIMEOUT_S)
    try:
        msg = wire.recv(handle.data)
    finally:
        handle.data.settimeout(None)
    if msg is None:
        handle.proc.join(5)
        if handle.proc.is_alive():  # wire.recv reads a timeout as the end of the stream
            return EngineDeadError(f"the engine core did not start within "
                                   f"{START_TIMEOUT_S:g} s")
        return EngineDeadError(f"the engine core process exited while starting (exit code "
                               f"{handle.proc.exitcode}; its error is on stderr)")
    if msg[0] == "dead":
        return wire.load_error(msg[1])
    return None


def probe(control: socket.socket, frames: wire.FrameBuffer, probe_id: int, timeout: float,
          wait: float) -> list[Any] | None:
    """Send a health probe and wait up to `wait` s for the reply that carries its id
    (a late reply to an earlier probe that timed out is read and discarded). None when
    the core closed the socket; a timeout is EngineUnhealthyError, not death."""
    try:
        wire.send(control, ["health", probe_id, timeout])
    except OSError:
        return None
    deadline = time.monotonic() + wait
    while True:
        for reply in frames.take():
            if reply[0] == probe_id:
                return reply
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([control], [], [], left)[0]:
            raise EngineUnhealthyError(f"the engine core did not answer a health probe "
                                       f"within {wait:g} s")
        try:
            chunk = control.recv(1 << 16)
        except OSError:
            return None
        if not chunk:
            return None
        frames.feed(chunk)


class Restore:
    """What a new engine core is given before the requests: the LoRA adapters added through
    add_lora (id -> its wire form) and pinned, and the sleep level if asleep."""

    def __init__(self) -> None:
        self.loras: dict[int, list[Any]] = {}
        self.pinned: set[int] = set()
        self.sleep_level: int | None = None


class CoreRestartMixin:
    """EngineCoreClient's restart of a dead core (it reads the client's locks, request
    tables and outbox; see core_client)."""

    _core: CoreHandle
    _lock: threading.Lock
    _send_lock: threading.Lock
    _streams: dict[str, Any]
    _adds: dict[str, list[Any]]
    _calls: dict[int, Any]
    _restore: Restore
    _stopped: bool
    _restarting: bool
    _gen: int
    _start_args: tuple
    core_restarts: Any
    load: Any

    def _restart(self) -> bool:
        """The core process died: start a new one (within core_restarts; a start that fails
        counts and is tried again) and give it every request in flight, each from the
        tokens its stream has (a resumption), the waiting adds and calls, the loaded LoRA
        adapters and sleep. False when the limit is reached (or on shutdown)."""
        self._restarting = True
        try:
            handle = self._new_core()
            if handle is None:
                return False
            with self._send_lock, self._lock:
                if self._stopped:
                    handle.reap()
                    handle.close()
                    return False
                old, self._core = self._core, handle
                self._gen += 1
                self._control_frames = wire.FrameBuffer()
                self._worker_restarts_before = self.load.worker_restarts
                ended = self._resend()
            old.close()
        finally:
            self._restarting = False
        for accepted, stream, error in ended:
            if accepted is not None:
                settle(accepted)
            stream.put(error)
        return True

    def _new_core(self) -> CoreHandle | None:
        self._core.reap()
        error: BaseException = EngineDeadError(
            f"the engine core process died unexpectedly (exit code {self._proc.exitcode})")
        while not self._stopped:
            if not self.core_restarts.take():
                logger.error("the engine core died again after %d restarts (max %s within "
                             "%g s): giving up: %s", self.core_restarts.in_window(),
                             self.core_restarts.limit, self.core_restarts.window_s, error)
                return None
            logger.error("%s; starting a new engine core (restart %d) and resuming %d "
                         "requests", error, self.core_restarts.total,
                         len(self._streams) + len(self._adds))
            try:
                return start_core(*self._start_args)
            except Exception as e:  # noqa: BLE001 - counted, then tried again
                error = e
                time.sleep(min(2.0, 0.25 * self.core_restarts.in_window()))
        return None

    def _resend(self) -> list[tuple[Any, RequestStream, BaseException]]:
        """Under both locks, for the new core: what it must load, then every request in
        flight (resumed), the waiting adds, the waiting calls. Returns the adds that were
        aborted before being accepted (their streams end with the abort's error)."""
        # copies: the event loop's add_lora/pin_lora update them without these locks
        for lora in list(self._restore.loras.values()):
            self._restore_call("add_lora", lora)
        for lora_id in list(self._restore.pinned):
            self._restore_call("pin_lora", lora_id)
        ended = []
        for request_id, (stream, state) in list(self._streams.items()):
            try:
                self._put("add", wire.encode(state.resume_msg()))
            except InvalidRequestError as e:  # not expected: what it streamed was encodable
                del self._streams[request_id]
                ended.append((None, stream, e))
        for request_id, (accepted, stream, state, _, aborted) in list(self._adds.items()):
            if aborted is not None:
                del self._adds[request_id]
                ended.append((accepted, stream, aborted))
            else:
                self._put("add", wire.encode(["add", *state.add]))
        for _, body in list(self._calls.values()):
            self._put("call", body)
        if self._restore.sleep_level is not None:
            self._restore_call("sleep", self._restore.sleep_level)
        return ended

    def _restore_call(self, name: str, arg: Any) -> None:
        done = self._queue_call(name, arg)
        done.add_done_callback(lambda f: f.exception() and logger.error(
            "restoring %s(%r) on the new engine core failed: %s", name, arg, f.exception()))
