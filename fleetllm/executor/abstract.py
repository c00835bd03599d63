"""The Executor: one API over one or many workers, whatever process layout runs them.

Subclasses implement `_init_executor` (start the workers) and `collective_rpc` (call a method
on every worker, results in rank order). Everything else is built on collective_rpc.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

from fleetllm.config import EngineConfig
from fleetllm.distributed.parallel_state import output_rank
from fleetllm.errors import ConfigurationError
from fleetllm.sequence import ExecuteModelRequest, SamplerOutput
from fleetllm.utils import resolve_qualname

R = TypeVar("R")
RpcMethod = str | Callable[..., Any]


class Executor(ABC):
    uses_ray: bool = False
    supports_pp: bool = False

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        backend = config.parallel_config.distributed_executor_backend
        if isinstance(backend, type):
            if not issubclass(backend, Executor):
                raise ConfigurationError(f"distributed_executor_backend: {backend!r} is not an "
                                         "Executor subclass")
            return backend
        if backend == "uni":
            from fleetllm.executor.uniproc import UniProcExecutor
            return UniProcExecutor
        if backend == "mp":
            from fleetllm.executor.multiproc import MultiprocExecutor
            return MultiprocExecutor
        if backend == "ray":  # without Ray installed, constructing it says how to get Ray
            from fleetllm.executor.ray_executor import RayDistributedExecutor
            return RayDistributedExecutor
        if isinstance(backend, str) and ":" in backend:
            cls = resolve_qualname(backend)
            if isinstance(cls, type) and issubclass(cls, Executor):
                return cls
        raise ConfigurationError(f"distributed_executor_backend: {backend!r} is not 'uni', 'mp',"
                                 " 'ray', an Executor subclass or 'module:Class' naming one")

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = config.model_config
        self.cache_config = config.cache_config
        self.parallel_config = config.parallel_config
        self.scheduler_config = config.scheduler_config
        self.device_config = config.device_config
        self.load_config = config.load_config
        self.is_sleeping = False
        self.sleeping_tags: set[str] = set()
        self._is_shutdown = False
        if config.parallel_config.pipeline_parallel_size > 1 and not self.supports_pp:
            raise ConfigurationError(f"pipeline_parallel_size: {type(self).__name__} does not "
                                     "support pipeline parallelism; use 'mp' or 'ray'")
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers: create, init_device, load_model."""

    @abstractmethod
    def collective_rpc(self, method: RpcMethod, timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None,
                       return_exceptions: bool = False) -> list[Any]:
        """Run `method` (a Worker method name, or a callable taking the worker first) on every
        worker; one result per worker in rank order. A worker's exception raises here with the
        rank and remote traceback (or is returned in place with return_exceptions=True); a call
        past `timeout` seconds raises CommunicationTimeoutError."""

    @property
    def output_rank(self) -> int:
        """The rank whose execute_model result is the step's output (see
        parallel_state.output_rank: the last pipeline stage's tensor rank 0)."""
        pc = self.parallel_config
        return output_rank(pc.tensor_parallel_size, pc.pipeline_parallel_size)

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> list[SamplerOutput]:
        return self.collective_rpc("execute_model", args=(execute_model_req,))[self.output_rank]

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(num_gpu_blocks, num_cpu_blocks) that fit on every worker: the minimum over them."""
        results = self.collective_rpc("determine_num_available_blocks")
        return min(r[0] for r in results), min(r[1] for r in results)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_config.num_gpu_blocks = num_gpu_blocks
        self.cache_config.num_cpu_blocks = num_cpu_blocks
        self.collective_rpc("initialize_cache", args=(num_gpu_blocks, num_cpu_blocks))

    def check_health(self) -> None:
        """Raise if any worker is unhealthy."""
        self.collective_rpc("check_health", timeout=30)

    def shutdown(self) -> None:
        """Stop the workers and free their resources. Safe to call more than once."""
        if self._is_shutdown:
            return
        self._is_shutdown = True
        self._shutdown()

    def _shutdown(self) -> None:
        """Backend-specific cleanup."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if getattr(self, "_is_shutdown", True) is False:
            try:
                self.shutdown()
            except Exception:
                pass


ExecutorBase = Executor
