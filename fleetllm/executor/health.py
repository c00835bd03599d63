"""WorkerAccess: who may talk to an executor's workers, and what is known about them meanwhile.

One executor-wide re-entrant lock orders every call to the workers (a step, a collective_rpc,
a restart). It also spans the timed-out window (failures.py): only the thread whose step timed
out may call next, others wait, so a /health probe or /metrics scrape never kills a slow step;
a window left open longer than the second wait would take is abandoned. check_health never
queues behind a step: while the workers are busy it answers from what is known (the backend's
crash detection, whether the step outlived execute_model_timeout).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fleetllm.errors import CommunicationTimeoutError, WorkerCrashedError


class WorkerAccess:
    def __init__(self, step_timeout: Callable[[], float]) -> None:
        self._step_timeout = step_timeout  # execute_model_timeout, read when needed
        self.lock = threading.RLock()
        self._window_closed = threading.Condition(self.lock)
        self._outstanding: Any = None  # the backend's state of a timed-out step
        self._owner: int | None = None  # the thread that left it outstanding
        self._outstanding_since = 0.0
        self.step_started: float | None = None  # a step runs (or is outstanding) since
        self._in_step = False  # inside step(): this thread holds the lock
        self.restarting = False

    # ------------------------------------------------------------------ the timed-out window

    @property
    def outstanding(self) -> Any:
        return self._outstanding

    @outstanding.setter
    def outstanding(self, step: Any) -> None:
        """Open (a step's state) or close (None) the timed-out window."""
        with self.lock:
            self._outstanding = step
            if step is None:
                self._owner = None
                self._window_closed.notify_all()
            else:
                self._owner = threading.get_ident()
                self._outstanding_since = time.monotonic()

    @contextlib.contextmanager
    def exclusive(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the lock for one call (re-entrant), waiting out another thread's timed-out
        window (see the module docstring); CommunicationTimeoutError past `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.lock.acquire(timeout=-1 if timeout is None else timeout):
            raise CommunicationTimeoutError(f"collective_rpc: the workers stayed busy with "
                                            f"another call for timeout={timeout}s")
        try:
            while self._outstanding is not None and self._owner != threading.get_ident():
                abandon = self._outstanding_since + 2 * self._step_timeout() + 1.0
                end = abandon if deadline is None else min(deadline, abandon)
                left = end - time.monotonic()
                if left <= 0:
                    if deadline is not None and deadline <= abandon:
                        raise CommunicationTimeoutError(
                            f"collective_rpc: a timed-out step kept the workers busy for "
                            f"timeout={timeout}s")
                    break  # abandoned: this call gives the step up
                self._window_closed.wait(left)
            yield
        finally:
            self.lock.release()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Hold the lock for one execute_model, marked as running for check_health (still
        running after it returns, while it is outstanding)."""
        with self.exclusive():
            self.step_started = time.monotonic()
            self._in_step = True
            try:
                yield
            finally:
                self._in_step = False
                if self._outstanding is None:
                    self.step_started = None

    def step_settled(self) -> None:
        """The outstanding step was waited for or given up (also by a new step, which then
        keeps its own start time)."""
        self.outstanding = None
        if not self._in_step:
            self.step_started = None

    # ------------------------------------------------------------------------------ health

    def check(self, ping: Callable[[float], None], known: Callable[[], None],
              timeout: float) -> None:
        """ping(timeout) asks every worker; known() raises what is known without asking."""
        if self.restarting:  # (only another thread can see this)
            raise WorkerCrashedError("the workers are being restarted after a failure")
        if self.step_started is None and self.lock.acquire(timeout=timeout):
            try:
                if self.step_started is None and self._outstanding is None:
                    ping(timeout)
                    return
            finally:
                self.lock.release()
        known()
        started = self.step_started
        limit = self._step_timeout()
        if started is not None and time.monotonic() - started > limit:
            raise CommunicationTimeoutError(f"a step has run for more than "
                                            f"execute_model_timeout={limit}s")
