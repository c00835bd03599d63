from typing import Any

from fleetllm.executor.abstract import Executor, ExecutorBase
from fleetllm.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "ExecutorBase", "MultiprocExecutor", "RayDistributedExecutor",
           "UniProcExecutor"]


def __getattr__(name: str) -> Any:  # the mp and ray backends load only when asked for
    if name == "MultiprocExecutor":
        from fleetllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    if name == "RayDistributedExecutor":  # importable without Ray; constructing it needs Ray
        from fleetllm.executor.ray_executor import RayDistributedExecutor

        return RayDistributedExecutor
    raise AttributeError(f"module 'fleetllm.executor' has no attribute {name!r}")
