from typing import Any

from fleetllm.executor.abstract import Executor, ExecutorBase
from fleetllm.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "ExecutorBase", "MultiprocExecutor", "UniProcExecutor"]


def __getattr__(name: str) -> Any:  # the mp backend loads only when asked for
    if name == "MultiprocExecutor":
        from fleetllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    raise AttributeError(f"module 'fleetllm.executor' has no attribute {name!r}")
