"""The failure rules of execute_model, shared by the backends whose workers are other processes
(mp, ray), and the portable form in which a worker reports an exception.

A step's ranks run collectives together, so one rank failing or stalling mid-step leaves its
peers out of step: the executor stops every worker and refuses later calls. Only when every
rank raises the same error before entering any collective (each reports whether it entered
one) does the executor stay usable and raise that error; a rank silent for
EXEC_ERROR_GRACE_S after a first error is presumed inside a collective. No reply within
execute_model_timeout raises CommunicationTimeoutError with the step outstanding:
`wait_for_timed_out_step()` waits once more; after that, or any other call instead, the ranks
count as hung and the executor fails (the engine restarts the workers).
"""

from __future__ import annotations

import pickle
import traceback

from fleetllm.errors import WorkerCrashedError, as_out_of_memory

ERROR_GRACE_S = 0.05  # collective_rpc: after a first error, wait this long for other replies
# execute_model: after a first error raised before any collective, how long the other ranks
# get to report the same error (a rank that does not is presumably waiting in a collective).
EXEC_ERROR_GRACE_S = 2.0

ErrorPayload = tuple[bytes | None, str, str, str]


def error_payload(exc: BaseException) -> ErrorPayload:
    """(pickled exception or None, type name, message, formatted traceback): survives any
    exception, including one that cannot be pickled or rebuilt on the driver. An allocation
    failure travels as OutOfMemoryError (errors.as_out_of_memory), whatever raised it."""
    exc = as_out_of_memory(exc)
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        blob = None
    return blob, type(exc).__name__, str(exc), tb


def load_error(payload: ErrorPayload) -> tuple[BaseException, str]:
    """The worker's exception (or a stand-in when it cannot be unpickled here) and traceback."""
    blob, type_name, message, tb = payload
    if blob is not None:
        try:
            exc = pickle.loads(blob)
            if isinstance(exc, BaseException):
                return exc, tb
        except Exception:
            pass
    return RuntimeError(f"{type_name}: {message}"), tb


def out_of_step(info: dict[int, tuple[str, str, bool]], done: dict[int, bool]) -> str | None:
    """Why the errors of an execute_model call so far may leave the ranks' collectives out of
    step (None: not yet known). `info`: rank -> (error type, message, entered a collective);
    `done`: rank -> whether it has reported (a result or an error)."""
    entered = [r for r, (_, _, e) in info.items() if e]
    if entered:
        return f"after entering a collective operation (ranks {entered})"
    finished = [r for r, d in sorted(done.items()) if d and r not in info]
    if finished:
        return f"while ranks {finished} completed the step"
    if len({(t, m) for t, m, _ in info.values()}) > 1:
        return "while other ranks raised different errors"
    return None


def step_failed_error(rank: int, remote: BaseException, reason: str) -> WorkerCrashedError:
    """The error of an execute_model call that left the ranks possibly out of step."""
    return WorkerCrashedError(
        f"execute_model failed on worker rank {rank} {reason}; the ranks' collective "
        "operations may be out of step, so every worker was stopped and the executor is "
        f"unusable: create a new one\n{remote.args[0]}", rank=rank)


def step_timeout_message(missing: list[int], timeout: float | None) -> str:
    return (f"execute_model: no reply from worker ranks {missing} within "
            f"execute_model_timeout={timeout}s")


def step_outstanding_message(missing: list[int], timeout: float | None) -> str:
    return (f"{step_timeout_message(missing, timeout)}; the step is still outstanding: "
            "wait_for_timed_out_step() waits once more, any other call gives up on the workers")
