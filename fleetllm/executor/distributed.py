"""DistributedExecutor: the one failure state machine of the backends whose workers are other
processes ("mp", "ray"); a backend supplies transport only (`_send`, `_replies`,
`_stop_workers`), and failures.py's rules apply here once.

- collective_rpc: results in rank order; a rank's error raises with its rank and traceback
  (or is returned); no reply in `timeout` is a CommunicationTimeoutError, executor usable.
- execute_model: a rank's error fails the executor (WorkerCrashedError, cause chained) unless
  every rank raised it before any collective; a RESYNC reply resends the step in full; a
  timeout leaves the step for wait_for_timed_out_step(), then the workers count as hung.
- A dead worker fails every call until restart_failed_workers(); after shutdown():
  EngineShutdownError.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NoReturn

from fleetllm.errors import CommunicationTimeoutError, EngineShutdownError, WorkerCrashedError
from fleetllm.executor.abstract import Executor, RpcMethod
from fleetllm.executor.failures import (
    ERROR_GRACE_S,
    EXEC_ERROR_GRACE_S,
    out_of_step,
    step_failed_error,
    step_outstanding_message,
    step_timeout_message,
)
from fleetllm.sequence import ExecuteModelRequest, SamplerOutput
from fleetllm.worker.delta import DeltaEncoder

OK, ERR, RESYNC = "ok", "err", "resync"
# A reply: (rank, OK, value) | (rank, ERR, (remote error, type name, message, entered a
# collective)) | (rank, RESYNC, None).
Reply = tuple[int, str, Any]


class _Resync(Exception):
    """Workers could not decode a delta-encoded request: send it again in full."""


def method_name(method: RpcMethod) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", "callable")


class DistributedExecutor(Executor):
    delta_encoding = True  # set False (class or instance) to send full requests every step

    def _init_failure_state(self) -> None:
        """Backends call this first in _init_executor (a restart too)."""
        self._encoder = DeltaEncoder()
        self._failure: WorkerCrashedError | None = None

    # ------------------------------------------------------------------ backend transport

    def _send(self, method: RpcMethod, args: tuple, kwargs: dict[str, Any] | None,
              step: bool, deadline: float | None) -> Any:
        """Send one call to every rank; a handle for _replies. step: an execute_model
        request (maybe delta encoded) that only the output rank answers in full."""
        raise NotImplementedError

    def _replies(self, handle: Any, timeout: float | None) -> list[Reply]:
        """Replies to `handle` that arrive within `timeout` (None: wait for some). A dead
        rank raises (self._crashed)."""
        raise NotImplementedError

    def _stop_workers(self) -> None:
        """Stop every worker at once (one in a collective cannot be asked to exit)."""
        raise NotImplementedError

    def _await_deaths(self, handle: Any) -> None:
        """A step failed inside a collective, often a peer's death reported late: a backend
        may wait briefly for ranks still out to be reported dead (and raise that instead)."""

    def _check_alive(self) -> None:
        """Between waits: raise if the backend's own monitor saw a worker die."""
        self._raise_if_unusable()

    # ------------------------------------------------------------------------- failure

    def _raise_if_unusable(self) -> None:
        super()._raise_if_unusable()
        if self._is_shutdown:
            earlier = "" if self._failure is None else \
                f" (it had failed before: {self._failure.args[0].splitlines()[0]})"
            raise EngineShutdownError(f"the executor is shut down{earlier}; create a new one")
        if self._failure is not None:
            f = self._failure
            raise WorkerCrashedError(f.args[0], rank=f.rank, exitcode=f.exitcode)

    def _fail(self, error: WorkerCrashedError) -> None:
        """Give up on the workers: every later call raises `error`."""
        self._encoder.need_reset = True
        if self._failure is None:
            self._failure = error
        self._stop_workers()

    def _crashed(self, error: WorkerCrashedError, cause: BaseException | None = None
                 ) -> NoReturn:
        if self._is_shutdown:  # shutdown() stopped the workers under a call in another thread
            raise EngineShutdownError("the executor was shut down during this call") from cause
        self._fail(error)
        raise self._failure from cause

    # ------------------------------------------------------------------------------ calls

    def collective_rpc(self, method: RpcMethod, timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None,
                       return_exceptions: bool = False) -> list[Any]:
        with self.access.exclusive(timeout):  # the timeout covers waiting for a step too
            self._give_up_outstanding_step()
            self._raise_if_unusable()
            deadline = None if timeout is None else time.monotonic() + timeout
            handle = self._send(method, tuple(args), kwargs, False, deadline)
            return self._collect(handle, deadline, return_exceptions, step=False,
                                 too_late=lambda missing: (
                                     f"collective_rpc({method_name(method)!r}) got no reply "
                                     f"from worker ranks {missing} within timeout={timeout}s"))

    def _execute_model(self, execute_model_req: ExecuteModelRequest) -> list[SamplerOutput]:
        self._give_up_outstanding_step()
        self._raise_if_unusable()
        try:
            if not self.delta_encoding:
                return self._step(execute_model_req)
            try:
                return self._step(self._encoder.encode(execute_model_req))
            except _Resync:
                return self._step(self._encoder.encode(execute_model_req, full=True))
        except BaseException:  # the workers may hold part of this step: resend in full
            self._encoder.need_reset = True
            raise

    def _step(self, request: Any) -> list[SamplerOutput]:
        timeout = self.parallel_config.execute_model_timeout
        deadline = time.monotonic() + timeout
        handle = self._send("execute_model", (request,), None, True, deadline)
        return self.step_output(self._collect(handle, deadline, False, step=True))

    def _wait_timed_out_step(self) -> list[SamplerOutput]:
        handle, state = self.access.outstanding
        timeout = self.parallel_config.execute_model_timeout
        try:
            result = self._collect(handle, time.monotonic() + timeout, False, step=True,
                                   state=state)
        except BaseException:
            self._encoder.need_reset = True
            raise
        return self.step_output(result)

    def _give_up_outstanding_step(self) -> None:
        """The caller made another call instead of waiting for the timed-out step again."""
        if self.access.outstanding is None:
            return
        _, (_, done) = self.access.outstanding
        self.access.step_settled()
        what = step_timeout_message(_pending(done),
                                    self.parallel_config.execute_model_timeout)
        self._fail(WorkerCrashedError(f"{what}; the step was not waited for again, so the "
                                      "workers were stopped: create a new executor"))

    def _hung(self, what: str, missing: list[int] | None, cause: BaseException | None = None
              ) -> NoReturn:
        """A step got no reply in time: the ranks are stuck (in the model, or in a collective
        whose peer is gone); a collective cannot be interrupted, so every worker goes."""
        self._fail(WorkerCrashedError(
            f"{what}; the workers were stopped and the executor is unusable: create a new one",
            rank=missing[0] if missing and len(missing) == 1 else None))
        raise CommunicationTimeoutError(f"{what}; every worker was stopped, the executor is "
                                        "unusable: create a new one") from cause

    def _collect(self, handle: Any, deadline: float | None, return_exceptions: bool,
                 step: bool, too_late: Callable[[list[int]], str] | None = None,
                 state: tuple[dict[int, Any], dict[int, bool]] | None = None,
                 ranks: list[int] | None = None) -> list[Any]:
        """The replies to `handle` from `ranks` (default: every rank), in that order, with the
        rules of the module docstring. state: (results, done) of a step that timed out once
        and is waited for again."""
        ranks = list(range(self.world_size)) if ranks is None else ranks
        results, done = state or ({}, dict.fromkeys(ranks, False))
        errors: dict[int, BaseException] = {}  # in order of arrival
        info: dict[int, tuple[str, str, bool]] = {}  # (type, message, entered a collective)
        resync = False
        error_deadline = None
        grace = EXEC_ERROR_GRACE_S if step else ERROR_GRACE_S
        while not all(done.values()):
            now = time.monotonic()
            ends = [t for t in (deadline, error_deadline) if t is not None]
            if ends and min(ends) <= now:
                break
            for rank, status, value in self._replies(handle, min(ends) - now if ends else None):
                if done.get(rank, True):
                    continue  # a late reply to an earlier call: dropped
                done[rank] = True
                if status == OK:
                    results[rank] = value
                elif status == RESYNC:
                    resync = True
                else:
                    errors[rank], type_name, message, entered = value
                    info[rank] = (type_name, message, entered)
            if errors and not return_exceptions and not resync and error_deadline is None:
                error_deadline = time.monotonic() + grace
            if step and errors:
                reason = out_of_step(info, done)
                if reason is not None:
                    self._step_failed(handle, errors, reason)
            if not all(done.values()):
                self._check_alive()
        missing = _pending(done)
        if step and errors and missing:
            self._step_failed(handle, errors, f"while ranks {missing} did not report the same "
                                              "error in time (presumably waiting in a "
                                              "collective operation)")
        if resync and not missing:
            raise _Resync()
        if errors and not return_exceptions:
            raise errors[min(errors)]
        if missing:
            timeout = self.parallel_config.execute_model_timeout
            if step and state is None:  # failures.py: the caller may wait once more
                self.access.outstanding = (handle, (results, done))
                raise CommunicationTimeoutError(step_outstanding_message(missing, timeout))
            if step:
                self._hung(f"{step_timeout_message(missing, timeout)}, twice", missing)
            raise CommunicationTimeoutError(too_late(missing) if too_late else
                                            f"no reply from worker ranks {missing}")
        return [errors.get(r, results.get(r)) for r in ranks]

    def _step_failed(self, handle: Any, errors: dict[int, BaseException], reason: str
                     ) -> NoReturn:
        """The step failed with the ranks possibly out of step: stop every worker."""
        self._await_deaths(handle)
        rank, remote = next(iter(errors.items()))
        error = step_failed_error(rank, remote, reason)
        self._fail(error)
        raise error from remote


def _pending(done: dict[int, bool]) -> list[int]:
    return [r for r, d in sorted(done.items()) if not d]
