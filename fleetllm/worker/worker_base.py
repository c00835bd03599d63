"""WorkerBase (what every worker implements) and WorkerWrapperBase (builds the configured one
and runs the worker side of every backend that drives worker processes: mp and ray)."""

from __future__ import annotations

import mmap
import os
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from fleetllm.config import EngineConfig
from fleetllm.sequence import ExecuteModelRequest, SamplerOutput
from fleetllm.utils import resolve_qualname
from fleetllm.worker.delta import DeltaDecoder, EncodedRequest

# Wraps the configured worker when speculative decoding is on. Named, not imported: the spec
# worker is a WorkerBase, so importing it here would be an import circle.
SPEC_WORKER = "fleetllm.spec_decode.spec_decode_worker.create_spec_worker"
MULTI_STEP_WORKER = "fleetllm.worker.multi_step_worker.MultiStepWorker"  # likewise


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


class DelegatingWorker(WorkerBase):
    """A worker around another one (`self.worker`): every call goes to it unless overridden.
    The workers the configuration adds around the configured one (MultiStepWorker,
    SpecDecodeWorker) override execute_model and little else."""

    def __init__(self, worker: WorkerBase) -> None:
        self.worker = worker

    def init_device(self) -> None:
        self.worker.init_device()

    def load_model(self) -> None:
        self.worker.load_model()

    def determine_num_available_blocks(self) -> tuple[int, int]:
        return self.worker.determine_num_available_blocks()

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.initialize_cache(num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, execute_model_req: ExecuteModelRequest
                      ) -> list[SamplerOutput] | None:
        return self.worker.execute_model(execute_model_req)

    def check_health(self) -> None:
        self.worker.check_health()

    def shutdown(self) -> None:
        self.worker.shutdown()

    def __getattr__(self, name: str) -> Any:  # sleep, wake_up, LoRA calls, model_runner, ...
        if name == "worker":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.worker, name)


def run_method(obj: Any, method: str | Callable[..., Any], args: tuple,
               kwargs: dict[str, Any]) -> Any:
    """Call obj.method(*args, **kwargs), or method(obj, *args, **kwargs) for a callable."""
    if isinstance(method, str):
        return getattr(obj, method)(*args, **kwargs)
    return method(obj, *args, **kwargs)


class StepInterrupts:
    """A count of interrupts, bumped by the executor and read by the output rank between
    passes. In this process's memory (uni, a Ray actor), or in a file that the mp driver and
    its workers map (8 bytes in the group's private temp dir): a write there is seen by the
    other processes without a message, while the worker's main thread is busy in the call."""

    _COUNT = struct.Struct("<Q")

    def __init__(self, path: str | None = None) -> None:
        self._lock = threading.Lock()
        if path is None:
            self._buf: bytearray | mmap.mmap = bytearray(self._COUNT.size)
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < self._COUNT.size:
                os.ftruncate(fd, self._COUNT.size)
            self._buf = mmap.mmap(fd, self._COUNT.size)
        finally:
            os.close(fd)

    @property
    def count(self) -> int:
        return self._COUNT.unpack_from(self._buf)[0]

    def buffer(self) -> bytearray | mmap.mmap:
        """The count's 8 bytes (native int64), for a C loop to read between its passes."""
        return self._buf

    def bump(self) -> None:
        with self._lock:  # one writer per process: the driver (mp) or this process
            self._COUNT.pack_into(self._buf, 0, self.count + 1)


def interrupts_path(tmpdir: str) -> str:
    """Where the mp driver and its workers share their StepInterrupts count."""
    return os.path.join(tmpdir, "interrupts")


class WorkerWrapperBase:
    """Creates the worker class named by parallel_config.worker_cls, so users can plug in their
    own (wrapped in a SpecDecodeWorker with speculative decoding, a MultiStepWorker with
    num_scheduler_steps > 1), and forwards calls to it. Its execute_model is the worker end
    of the delta encoding (fleetllm.worker.delta), shared by every backend that sends steps
    to worker processes."""

    def __init__(self, config: EngineConfig, rpc_rank: int = 0) -> None:
        self.config = config
        self.rpc_rank = rpc_rank
        self.worker: WorkerBase | None = None
        self.delta_decoder = DeltaDecoder()
        # Executor.interrupt_step bumps it; a MultiStepWorker ends its call on it. A backend
        # whose driver is another process replaces it with a shared one before init_worker.
        self.interrupts = StepInterrupts()

    def init_worker(self, local_rank: int, rank: int, distributed_init_method: str | None,
                    is_driver_worker: bool) -> None:
        self.rpc_rank = rank  # a backend may assign ranks only once it knows where workers run
        cls = resolve_qualname(self.config.parallel_config.worker_cls)
        worker = cls(self.config, local_rank=local_rank, rank=rank,
                     distributed_init_method=distributed_init_method,
                     is_driver_worker=is_driver_worker)
        if self.config.speculative_config is not None:  # the configured worker scores
            worker = resolve_qualname(SPEC_WORKER)(worker, self.config)
        elif self.config.scheduler_config.num_scheduler_steps > 1:
            worker = resolve_qualname(MULTI_STEP_WORKER)(worker, self.config, self.interrupts)
        self.worker = worker

    def execute_method(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return run_method(self.worker, method, args, kwargs)

    def execute_model(self, request: ExecuteModelRequest | EncodedRequest
                      ) -> list[SamplerOutput] | None:
        """One step. An EncodedRequest is first rebuilt from this rank's delta cache; when the
        cache does not match it raises DeltaDesync before anything has run (the driver then
        resends the step in full). Calls the worker's execute_model attribute at call time, so
        a test may replace it on one rank."""
        if isinstance(request, EncodedRequest):
            request = self.delta_decoder.decode(request)
        return self.worker.execute_model(request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)
