"""Typed errors. Every error fleetllm raises on purpose is a FleetLLMError with a stable code.

Messages say what happened and what to do about it.
"""

from __future__ import annotations

import builtins
import re
from functools import cache


class FleetLLMError(Exception):
    code = "E000"

    def __str__(self) -> str:
        return f"[{self.code}] {super().__str__()}"


class OutOfMemoryError(FleetLLMError, MemoryError):
    code = "E001"


def as_out_of_memory(exc: BaseException) -> BaseException:
    """`exc`, or an OutOfMemoryError (caused by it) when it is an allocation failure in any of
    its forms: torch's CPU allocator raises RuntimeError ("DefaultCPUAllocator: can't allocate
    memory"), CUDA's torch.OutOfMemoryError, Python's MemoryError. Workers classify before an
    error crosses the process boundary, so the engine's retry-smaller sees every real one."""
    if isinstance(exc, OutOfMemoryError):
        return exc
    text = str(exc)
    allocator_failure = isinstance(exc, RuntimeError) and not isinstance(exc, FleetLLMError) \
        and ("can't allocate memory" in text or "out of memory" in text.lower())
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or \
            allocator_failure:
        oom = OutOfMemoryError(f"{type(exc).__name__}: {text}")
        oom.__cause__ = exc
        return oom
    return exc


class WorkerCrashedError(FleetLLMError, RuntimeError):
    code = "E002"

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode

    @property
    def exit_code(self) -> int | None:  # both spellings are in common use
        return self.exitcode

    def __reduce__(self):
        return (type(self), (self.args[0], self.rank, self.exitcode))


class CommunicationTimeoutError(FleetLLMError, TimeoutError):
    code = "E003"


class ModelLoadError(FleetLLMError, OSError):
    code = "E004"

    def __str__(self) -> str:  # OSError formats its args itself; keep one plain message
        return f"[{self.code}] {self.args[0] if self.args else ''}"


class ConfigurationError(FleetLLMError, ValueError):
    """An invalid or incompatible setting. Also a ValueError, so generic handlers catch it."""

    code = "E005"


class RemoteWorkerError(FleetLLMError, RuntimeError):
    """A worker raised while serving a call. The message holds the rank and remote traceback."""

    code = "E006"


@cache
def _remote_class(cls: type[BaseException]) -> type[BaseException]:
    """The class a worker-side exception is re-raised as in the caller.

    fleetllm errors keep their own type; a builtin exception type (ValueError, KeyError, ...)
    becomes a subclass of both it and RemoteWorkerError, so `except ValueError` still works.
    """
    if issubclass(cls, FleetLLMError):
        return cls
    if getattr(builtins, cls.__name__, None) is cls and issubclass(cls, Exception):
        return type(f"Remote{cls.__name__}", (RemoteWorkerError, cls), {})
    return RemoteWorkerError


def remote_error(rank: int, exc: BaseException, remote_traceback: str) -> BaseException:
    """Wrap an exception raised by worker `rank` with the rank and its traceback."""
    message = f"worker rank {rank} raised {type(exc).__name__}: {exc}\n" \
              f"--- remote traceback (rank {rank}) ---\n{remote_traceback}"
    cls = _remote_class(type(exc))
    try:
        err = cls(message)
    except Exception:
        err = RemoteWorkerError(message)
    if isinstance(err, WorkerCrashedError) and isinstance(exc, WorkerCrashedError):
        err.rank, err.exitcode = exc.rank, exc.exitcode
    err.rank = getattr(err, "rank", None) or rank
    err.remote_traceback = remote_traceback
    return err


class EngineShutdownError(FleetLLMError, RuntimeError):
    """The LLM / engine / executor was shut down (or is shutting down): create a new one.
    Not a crash: nothing is restarted or retried on it."""

    code = "E008"


class InvalidRequestError(FleetLLMError, ValueError):
    """A request that can never be served (too long, bad token ids, duplicate id, ...).
    Rejected before it is queued; other requests are unaffected.

    `param`: the request field at fault (the server's 400 names it), given, or read from a
    message that starts with it ("stop_token_ids: ..."), so that it survives any boundary
    that carries only the class name and the message (the engine-core process's wire)."""

    code = "E007"

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param if param is not None else _leading_param(message)

    def __reduce__(self):
        return (type(self), (self.args[0] if self.args else "", self.param))


_PARAM_PREFIX = re.compile(r"([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*): ")


def _leading_param(message: object) -> str | None:
    """"name: ..." -> "name" (a lower-case field name or dotted path), else None."""
    match = _PARAM_PREFIX.match(message) if isinstance(message, str) else None
    return match.group(1) if match else None


class LoRAAdapterError(InvalidRequestError, ConfigurationError):
    """A LoRA adapter that cannot be served (unsupported modules, DoRA, rank above
    max_lora_rank, no safetensors file, ...): the request or add_lora naming it is refused.
    Both an InvalidRequestError (that request only; HTTP 400) and a ConfigurationError."""


class EngineSleepingError(FleetLLMError, RuntimeError):
    """The engine is asleep (sleep() freed its KV cache, and maybe its weights): wake_up()
    first. Raised by a step with work to run (the requests stay queued and run after
    wake_up), and by sleep() while requests are in flight, whose KV cache it would discard."""

    code = "E009"


class RequestFailedError(FleetLLMError, RuntimeError):
    """The engine accepted a request and then ended it with finish_reason "error" (out of
    memory even alone in a step, or its samples outgrew the KV pool). The message says why."""

    code = "E010"


class PeerError(FleetLLMError, RuntimeError):
    """A benchmark's peer engine (llama.cpp's tools) is not built, or failed: the message says
    which, what to build (`make llamacpp`), and the tail of its output."""

    code = "E011"


class UpstreamError(FleetLLMError, RuntimeError):
    """`fleetllm proxy`: a prefill or decode instance could not be reached, timed out, or
    broke off its answer. `status` is the HTTP status the proxy answers with (502: unreachable
    or a broken answer, 504: timed out); the message names the instance's URL and leg."""

    code = "E012"

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status
