"""WorkerBase (what every worker implements) and WorkerWrapperBase (builds the configured one)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from fleetllm.config import EngineConfig
from fleetllm.sequence import ExecuteModelRequest, SamplerOutput
from fleetllm.utils import resolve_qualname


class WorkerBase(ABC):
    """One rank: owns a device, a model shard and its KV cache."""

    @abstractmethod
    def init_device(self) -> None: ...

    @abstractmethod
    def load_model(self) -> None: ...

    @abstractmethod
    def determine_num_available_blocks(self) -> tuple[int, int]: ...

    @abstractmethod
    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, execute_model_req: ExecuteModelRequest
                      ) -> list[SamplerOutput] | None: ...

    @abstractmethod
    def check_health(self) -> None: ...

    def shutdown(self) -> None:
        """Release resources held by this worker (process groups, caches)."""


def run_method(obj: Any, method: str | Callable[..., Any], args: tuple,
               kwargs: dict[str, Any]) -> Any:
    """Call obj.method(*args, **kwargs), or method(obj, *args, **kwargs) for a callable."""
    if isinstance(method, str):
        return getattr(obj, method)(*args, **kwargs)
    return method(obj, *args, **kwargs)


class WorkerWrapperBase:
    """Creates the worker class named by parallel_config.worker_cls, so users can plug in their
    own, and forwards calls to it."""

    def __init__(self, config: EngineConfig, rpc_rank: int = 0) -> None:
        self.config = config
        self.rpc_rank = rpc_rank
        self.worker: WorkerBase | None = None

    def init_worker(self, local_rank: int, rank: int, distributed_init_method: str | None,
                    is_driver_worker: bool) -> None:
        cls = resolve_qualname(self.config.parallel_config.worker_cls)
        self.worker = cls(self.config, local_rank=local_rank, rank=rank,
                          distributed_init_method=distributed_init_method,
                          is_driver_worker=is_driver_worker)

    def execute_method(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return run_method(self.worker, method, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)
