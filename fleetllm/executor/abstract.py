"""The Executor: one API over one or many workers, whatever process layout runs them.

Backends implement `_init_executor` (start the workers: create, init_device, load_model) and
`collective_rpc` (call a method on every worker, results in rank order); `_shutdown` frees
what they hold. Everything else is built on collective_rpc, with three collaborators the base
class composes:
- `access` (health.WorkerAccess): the executor-wide lock every call, step and restart holds,
  the timed-out-step window, and check_health;
- `sleep_state` (sleep.SleepState): what sleep() freed, and the KV cache epoch;
- `metrics` (metrics.MetricsRecorder): step latencies, request and token counts, restarts.

Workers in other processes (mp, ray) share the failure rules of distributed.py.
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

from fleetllm.config import EngineConfig
from fleetllm.distributed.parallel_state import output_rank
from fleetllm.errors import (
    CommunicationTimeoutError,
    ConfigurationError,
    EngineShutdownError,
    EngineSleepingError,
    WorkerCrashedError,
)
from fleetllm.executor.health import WorkerAccess
from fleetllm.executor.kv_output import KVOutputAggregator
from fleetllm.executor.loras import ResidentLoRAs
from fleetllm.executor.metrics import MetricsRecorder, performance_metrics
from fleetllm.executor.sleep import SleepState
from fleetllm.lora.request import LoRARequest
from fleetllm.sequence import ExecuteModelRequest, SamplerOutput
from fleetllm.utils import resolve_qualname

logger = logging.getLogger(__name__)

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
        # (No reference back to self: the executor must stay collectable by reference count,
        # which is what ends an mp executor's workers when its LLM is dropped.)
        pc = config.parallel_config
        self.access = WorkerAccess(lambda: pc.execute_model_timeout)
        self.sleep_state = SleepState()
        self.metrics = MetricsRecorder()
        lora = config.lora_config
        # The adapters the workers hold, restored on new workers after a restart.
        self.loras = None if lora is None else ResidentLoRAs(lora.max_cpu_loras)
        self._is_shutdown = False
        # KV transfer: every rank's KVConnectorOutput of a step, merged (kv_output.py).
        self.kv_output_aggregator = None if config.kv_transfer_config is None else \
            KVOutputAggregator(config.parallel_config.world_size)
        # Set when restart_failed_workers could not start new workers: calls raise it (the
        # executor is not shut down: another restart may work once the cause is gone).
        self._restart_failure: WorkerCrashedError | None = None
        if config.parallel_config.pipeline_parallel_size > 1 and not self.supports_pp:
            raise ConfigurationError(f"pipeline_parallel_size: {type(self).__name__} does not "
                                     "support pipeline parallelism; use 'mp' or 'ray'")
        try:
            self._init_executor()
        except BaseException:
            self._is_shutdown = True  # the backend cleaned up what it had started
            raise

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers: create, init_device, load_model. On failure, clean up what was
        started and raise."""

    @abstractmethod
    def collective_rpc(self, method: RpcMethod, timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None,
                       return_exceptions: bool = False) -> list[Any]:
        """Run `method` (a Worker method name, or a callable taking the worker first) on every
        worker; one result per worker in rank order. A worker's exception raises here with the
        rank and remote traceback (or is returned in place with return_exceptions=True); a call
        past `timeout` seconds raises CommunicationTimeoutError. Holds `access.exclusive()`."""

    def _shutdown(self) -> None:
        """Backend-specific cleanup."""

    # ------------------------------------------------------------------------------ steps

    @property
    def output_rank(self) -> int:
        """The rank whose execute_model result is the step's output (see
        parallel_state.output_rank: the last pipeline stage's tensor rank 0)."""
        pc = self.parallel_config
        return output_rank(pc.tensor_parallel_size, pc.pipeline_parallel_size)

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> list[SamplerOutput]:
        """One step on every worker; the output rank's result. Refused while asleep
        (EngineSleepingError), timed and counted (metrics). Backends change how a step
        travels in _execute_model."""
        self.sleep_state.raise_if_asleep()
        if self.loras is not None:
            self.loras.step(execute_model_req)
        with self.access.step():
            start = time.perf_counter()
            try:
                output = self._execute_model(execute_model_req)
            except BaseException:
                self.metrics.record_error()
                raise
        try:
            latency = time.perf_counter() - start
            self.metrics.record_step(start, latency, execute_model_req, output)
        except Exception:  # metrics must never fail a step
            logger.exception("recording execute_model metrics failed")
        return output

    def _execute_model(self, execute_model_req: ExecuteModelRequest) -> list[SamplerOutput]:
        return self.step_output(self.collective_rpc("execute_model", args=(execute_model_req,)))

    def step_output(self, results: list[Any]) -> list[SamplerOutput]:
        """A step's output from every rank's reply: the output rank's; with a KV connector,
        carrying every rank's KVConnectorOutput merged (KVOutputAggregator)."""
        if self.kv_output_aggregator is None:
            return results[self.output_rank]
        return self.kv_output_aggregator.merge_step(results, self.output_rank)

    def interrupt_step(self) -> None:
        """Ask a multi-step call under way (num_scheduler_steps > 1) to end after its current
        pass; the call returns the passes done. Any thread, at any time, without waiting: a
        call that starts later is not affected. The engine calls it when a request is aborted
        while a step runs. A backend reaches its output rank's StepInterrupts here (this
        default reaches none: the call runs all its passes)."""

    @property
    def step_outstanding(self) -> bool:
        """Did the last execute_model time out with its step still outstanding?"""
        return self.access.outstanding is not None

    def wait_for_timed_out_step(self) -> list[SamplerOutput]:
        """After execute_model raised CommunicationTimeoutError with the step outstanding:
        wait once more, as long again, for the same step's replies (distributed.py); if they
        do not come either, the workers are declared hung."""
        with self.access.exclusive():
            if self.access.outstanding is None:
                raise CommunicationTimeoutError("no execute_model step is outstanding")
            try:
                return self._wait_timed_out_step()
            finally:
                self.access.step_settled()

    def _wait_timed_out_step(self) -> list[SamplerOutput]:
        raise CommunicationTimeoutError("no execute_model step is outstanding")

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(num_gpu_blocks, num_cpu_blocks) that fit on every worker: the minimum over them."""
        results = self.collective_rpc("determine_num_available_blocks")
        return min(r[0] for r in results), min(r[1] for r in results)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_config.num_gpu_blocks = num_gpu_blocks
        self.cache_config.num_cpu_blocks = num_cpu_blocks
        self.collective_rpc("initialize_cache", args=(num_gpu_blocks, num_cpu_blocks))

    # ------------------------------------------------------------------- health, restart

    def check_health(self, timeout: float = 10.0) -> None:
        """A timed, side-effect-free check of every worker: each answers a ping with a small
        device operation (Worker.check_health) within `timeout`, else
        CommunicationTimeoutError; a dead worker raises WorkerCrashedError. Never queues
        behind a step or gives one up (health.WorkerAccess.check); never restarts anything:
        the engine does (LLMEngine.check_health)."""
        self.access.check(lambda t: self.collective_rpc("check_health", timeout=t),
                          self._raise_if_unusable, timeout)

    def _raise_if_unusable(self) -> None:
        """Raise if the workers are known to be gone, without asking them. Backends extend
        it (calling this first) with their own crash detection."""
        if self._restart_failure is not None and not self._is_shutdown:
            f = self._restart_failure
            raise WorkerCrashedError(f.args[0], rank=f.rank, exitcode=f.exitcode)

    def restart_failed_workers(self) -> None:
        """Replace every worker after a crash or a hang: stop them all (a broken process
        group cannot be mended one rank at a time), start fresh ones in a fresh group, load
        the weights and re-create the KV cache with the same number of blocks. What the old
        workers held (KV blocks, the swap pool) is gone (kv_cache_epoch moves): the engine
        recomputes its requests. Workers that were asleep come back asleep (SleepState).

        If starting the new workers fails, calls raise WorkerCrashedError (not
        EngineShutdownError): calling this again may succeed once the cause is gone."""
        with self.access.exclusive():
            if self._is_shutdown:
                raise EngineShutdownError("the executor is shut down; create a new one")
            num_gpu, num_cpu = self.cache_config.num_gpu_blocks, \
                self.cache_config.num_cpu_blocks
            self.access.restarting = True
            self.sleep_state.kv_lost()
            try:
                self._shutdown()
                self.access.step_settled()
                self._restart_failure = None
                self._init_executor()
                if num_gpu is not None:
                    self.initialize_cache(num_gpu, num_cpu or 0)
                self.sleep_state.restore(self.collective_rpc)
                if self.loras is not None:
                    self.loras.restore(self.collective_rpc)
            except BaseException as e:
                self._restart_failure = WorkerCrashedError(
                    f"restarting the workers failed: {type(e).__name__}: {e}; calling "
                    "restart_failed_workers() again may succeed once the cause is gone")
                raise self._restart_failure from e
            finally:
                self.access.restarting = False
            self.metrics.record_restart()

    # ------------------------------------------------------- LoRA adapters (vLLM's names)

    def _lora_state(self) -> ResidentLoRAs:
        if self.loras is None:
            raise ConfigurationError("enable_lora: LoRA adapters need enable_lora=True")
        return self.loras

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load the adapter on every worker (each its shards; kept in their host-memory LRU
        of max_cpu_loras). True once every worker holds it."""
        state = self._lora_state()
        ok = all(self.collective_rpc("add_lora", args=(lora_request,)))
        state.touch(lora_request)
        return ok

    def remove_lora(self, lora_id: int) -> bool:
        """Unload the adapter everywhere; False if no worker held it."""
        state = self._lora_state()
        state.remove(lora_id)
        return any(self.collective_rpc("remove_lora", args=(lora_id,)))

    def pin_lora(self, lora_id: int) -> bool:
        """Keep a loaded adapter from LRU eviction; False if it is not loaded."""
        state = self._lora_state()
        ok = all(self.collective_rpc("pin_lora", args=(lora_id,)))
        if ok:
            state.pinned.add(lora_id)
        return ok

    def list_loras(self) -> set[int]:
        """The ids of the adapters every worker holds."""
        self._lora_state()
        return set.intersection(*self.collective_rpc("list_loras"))

    @property
    def is_shut_down(self) -> bool:
        return self._is_shutdown

    def shutdown(self) -> None:
        """Stop the workers and free their resources. Safe to call more than once."""
        if self._is_shutdown:
            return
        self._is_shutdown = True
        self._shutdown()

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

    # ------------------------------------------------ lifecycle: metrics, sleep, sharded state

    def record_outputs(self, outputs: Iterable[Any]) -> None:
        """The engine reports each step's RequestOutputs: finished ones count as completed, or
        failed (finish_reason "error")."""
        self.metrics.record_outputs(outputs)

    def get_performance_metrics(self) -> dict[str, Any]:
        """ExecutorMetrics.to_dict(): request counts, execute_model latency (avg, p50/p95/p99
        in ms over the last 1000 calls), requests/s and tokens/s over those calls, per-worker
        RSS, CPU and KV pool size, KV blocks in use, workers active/failed, restarts, and
        speculative decoding's counts (None without it)."""
        return performance_metrics(self)

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_state.is_sleeping

    @property
    def sleeping_tags(self) -> set[str]:
        return set(self.sleep_state.tags)

    @property
    def kv_cache_epoch(self) -> int:
        """Moves whenever the workers' KV content is lost (sleep, restart)."""
        return self.sleep_state.kv_cache_epoch

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache on every worker (level 1; on an accelerator the weights also move
        to host memory), or the KV cache and the weights (level 2). execute_model raises
        EngineSleepingError until wake_up(). Call it with no request in flight (their KV cache
        is lost). Sleeping again is a no-op."""
        self.sleep_state.sleep(self.collective_rpc, level)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Restore "weights", "kv_cache" or both (None) on every worker; level-2 weights are
        loaded again from the checkpoint. Waking what is awake is a no-op."""
        self.sleep_state.wake_up(self.collective_rpc, tags)

    def save_sharded_state(self, path: str | os.PathLike, pattern: str | None = None,
                           max_size: int | None = None) -> None:
        """Every rank writes its own tensors to `path` (`pattern`, default
        model-rank-{rank}-part-{part}.safetensors; a new part past `max_size` bytes), rank 0
        the checkpoint's config and tokenizer files, then this writes the layout description.
        Load it with LLM(path, load_format="sharded_state") and the same tensor_parallel_size
        and pipeline_parallel_size."""
        from fleetllm.model.sharded_state import check_save_args, write_metadata

        if "weights" in self.sleep_state.tags:
            raise EngineSleepingError("save_sharded_state: the weights are asleep; "
                                      "wake_up(['weights']) first")
        path = os.fspath(path)
        pattern = check_save_args(path, pattern, max_size, self.model_config.model)
        os.makedirs(path, exist_ok=True)
        files = self.collective_rpc("save_sharded_state", args=(path, pattern, max_size))
        write_metadata(path, self.config, pattern, files)


ExecutorBase = Executor
