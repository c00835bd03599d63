"""The Executor: one API over one or many workers, whatever process layout runs them.

Subclasses implement `_init_executor` (start the workers) and `collective_rpc` (call a method
on every worker, results in rank order). Everything else is built on collective_rpc.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from fleetllm.config import EngineConfig
from fleetllm.distributed.parallel_state import output_rank
from fleetllm.errors import (
    CommunicationTimeoutError,
    ConfigurationError,
    EngineShutdownError,
    EngineSleepingError,
    WorkerCrashedError,
)
from fleetllm.executor.metrics import MetricsRecorder, WorkerUsage, worker_usage
from fleetllm.sequence import ExecuteModelRequest, SamplerOutput
from fleetllm.utils import resolve_qualname

logger = logging.getLogger(__name__)

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
        self.sleep_level = 0
        # Bumped whenever the workers' KV cache stops holding what was computed into it (sleep,
        # restart): an engine that sees it move must forget its cached prefixes and recompute
        # its running requests, whoever called sleep() or restart_failed_workers().
        self.kv_cache_epoch = 0
        self._is_shutdown = False
        # One executor-wide lock, owned here and never replaced: every call to the workers, a
        # restart, and the window between an execute_model timeout and the caller's decision
        # (wait_for_timed_out_step or give up) hold it (see _exclusive).
        self._lock = threading.RLock()
        self._window_closed = threading.Condition(self._lock)
        self._outstanding: Any = None  # a timed-out step's state (backends: _timed_out_step)
        self._outstanding_owner: int | None = None
        self._outstanding_since = 0.0
        self._step_started: float | None = None  # a step is running (or outstanding) since
        self._in_execute_model = False
        self._restarting = False
        self._restart_failure: WorkerCrashedError | None = None
        if config.parallel_config.pipeline_parallel_size > 1 and not self.supports_pp:
            raise ConfigurationError(f"pipeline_parallel_size: {type(self).__name__} does not "
                                     "support pipeline parallelism; use 'mp' or 'ray'")
        try:
            self._init_executor()
        except BaseException:
            self._is_shutdown = True  # the backend cleaned up what it had started
            raise

    # -------------------------------------------------------------- the executor-wide lock

    @property
    def _timed_out_step(self) -> Any:
        """The backend's state of an execute_model step that timed out and is still
        outstanding (None: none). Setting it opens or closes the timed-out window."""
        return self._outstanding

    @_timed_out_step.setter
    def _timed_out_step(self, step: Any) -> None:
        with self._lock:
            self._outstanding = step
            if step is None:
                self._outstanding_owner = None
                self._window_closed.notify_all()
            else:
                self._outstanding_owner = threading.get_ident()
                self._outstanding_since = time.monotonic()

    @contextlib.contextmanager
    def _exclusive(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the executor-wide lock for one call (re-entrant). While a timed-out step is
        outstanding only the thread that ran it may call (to wait for it or give it up);
        other threads wait until it decides, so that a health probe or a metrics scrape never
        gives up a slow step. A window left open longer than the second wait would take is
        abandoned: the next caller goes ahead, which gives up the step (failures.py)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise CommunicationTimeoutError(f"collective_rpc: the workers stayed busy with "
                                            f"another call for timeout={timeout}s")
        try:
            while self._outstanding is not None and \
                    self._outstanding_owner != threading.get_ident():
                abandon = self._outstanding_since + \
                    2 * self.parallel_config.execute_model_timeout + 1.0
                end = abandon if deadline is None else min(deadline, abandon)
                left = end - time.monotonic()
                if left <= 0:
                    if deadline is not None and deadline <= abandon:
                        raise CommunicationTimeoutError(
                            f"collective_rpc: a timed-out step kept the workers busy for "
                            f"timeout={timeout}s")
                    break
                self._window_closed.wait(left)
            yield
        finally:
            self._lock.release()

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

    def check_health(self, timeout: float = 10.0) -> None:
        """A timed, side-effect-free check of every worker: each answers a ping with a small
        device operation (Worker.check_health) within `timeout`, else
        CommunicationTimeoutError; a dead worker raises WorkerCrashedError. It never queues
        behind a running step (a ping would wait for it), nor gives up a timed-out one: while
        a step runs or is outstanding, or a restart or another call holds the workers, the
        check is what is known without asking them: the backend's own crash detection, and
        whether the step has outlived execute_model_timeout. It never restarts anything: the
        engine does (LLMEngine.check_health)."""
        if self._restarting:  # (only other threads can see this)
            raise WorkerCrashedError("the workers are being restarted after a failure")
        if self._step_started is None and self._lock.acquire(timeout=timeout):
            try:
                if self._step_started is None and self._outstanding is None:
                    self.collective_rpc("check_health", timeout=timeout)
                    return
            finally:
                self._lock.release()
        self._raise_if_unusable()
        started = self._step_started
        limit = self.parallel_config.execute_model_timeout
        if started is not None and time.monotonic() - started > limit:
            raise CommunicationTimeoutError(f"a step has run for more than "
                                            f"execute_model_timeout={limit}s")

    def _raise_if_unusable(self) -> None:
        """Raise if the workers are known to be gone, without asking them. Backends extend
        it (calling this first) with their own crash detection."""
        if self._restart_failure is not None and not self._is_shutdown:
            f = self._restart_failure
            raise WorkerCrashedError(f.args[0], rank=f.rank, exitcode=f.exitcode)

    @property
    def step_outstanding(self) -> bool:
        """Did the last execute_model time out with its step still outstanding?"""
        return self._outstanding is not None

    def wait_for_timed_out_step(self) -> list[SamplerOutput]:
        """After execute_model raised CommunicationTimeoutError with the step outstanding:
        wait once more, as long again, for the same step's replies (see
        executor/failures.py); if they do not come either, the workers are declared hung."""
        with self._exclusive():
            if self._outstanding is None:
                raise CommunicationTimeoutError("no execute_model step is outstanding")
            try:
                return self._wait_timed_out_step()
            finally:
                self._timed_out_step = None
                self._step_started = None

    def _wait_timed_out_step(self) -> list[SamplerOutput]:
        """Backends with a deadline: collect the outstanding step's replies."""
        raise CommunicationTimeoutError("no execute_model step is outstanding")

    def restart_failed_workers(self) -> None:
        """Replace every worker after a crash or a hang: stop them all (a broken process
        group cannot be mended one rank at a time), start fresh ones in a fresh group, load
        the weights and re-create the KV cache with the same number of blocks. What the old
        workers held (KV blocks, the swap pool) is gone (kv_cache_epoch moves): the engine
        recomputes its requests. An executor that was asleep is put back to sleep at the same
        level, with the same parts awake. Holds the executor-wide lock throughout: other
        threads' calls wait for it, a health probe says a restart is under way.

        If starting the new workers fails, calls raise WorkerCrashedError (not
        EngineShutdownError): the executor is not shut down, and a later call of this method
        may succeed once the cause is gone."""
        with self._exclusive():
            if self._is_shutdown:
                raise EngineShutdownError("the executor is shut down; create a new one")
            num_gpu, num_cpu = self.cache_config.num_gpu_blocks, \
                self.cache_config.num_cpu_blocks
            self._restarting = True
            self.kv_cache_epoch += 1
            try:
                self._shutdown()
                self._timed_out_step = None
                self._step_started = None
                self._restart_failure = None
                self._init_executor()
                if num_gpu is not None:
                    self.initialize_cache(num_gpu, num_cpu or 0)
                if self.sleeping_tags:  # as it was: asleep at its level, some parts awake
                    self.collective_rpc("sleep", args=(self.sleep_level,))
                    awake = sorted({"weights", "kv_cache"} - self.sleeping_tags)
                    if awake:
                        self.collective_rpc("wake_up", args=(awake,))
            except BaseException as e:
                self._restart_failure = WorkerCrashedError(
                    f"restarting the workers failed: {type(e).__name__}: {e}; calling "
                    "restart_failed_workers() again may succeed once the cause is gone")
                raise self._restart_failure from e
            finally:
                self._restarting = False
            self.metrics.record_restart()

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

    # ------------------------------------------------ lifecycle: metrics, sleep, sharded state

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every backend's execute_model, its own or inherited, runs through
        _track_execute_model: refused while asleep, timed and counted. So uni, mp, Ray and
        user-defined executors all get metrics and the sleep guard without doing anything."""
        super().__init_subclass__(**kwargs)
        impl = cls.execute_model
        if not getattr(impl, "_fleetllm_tracked", False):
            cls.execute_model = _track_execute_model(impl)  # type: ignore[method-assign]

    @property
    def metrics(self) -> MetricsRecorder:
        """This executor's counters (created on first use: __init__ is the backends')."""
        recorder = self.__dict__.get("_metrics")
        if recorder is None:
            recorder = self.__dict__.setdefault("_metrics", MetricsRecorder())
        return recorder

    def _record_step(self, latency_s: float, request: ExecuteModelRequest,
                     output: list[SamplerOutput] | None) -> None:
        """Called after each successful execute_model (a hook: subclasses may add to it)."""
        self.metrics.record_step(time.perf_counter() - latency_s, latency_s, request, output)

    def record_outputs(self, outputs: Iterable[Any]) -> None:
        """The engine reports each step's RequestOutputs: finished ones count as completed, or
        failed (finish_reason "error")."""
        self.metrics.record_outputs(outputs)

    def get_performance_metrics(self) -> dict[str, Any]:
        """ExecutorMetrics.to_dict(): request counts, execute_model latency (avg, p50/p95/p99
        in ms over the last 1000 calls), requests/s and tokens/s over those calls, per-worker
        RSS, CPU and KV pool size, KV blocks in use, workers active/failed, restarts."""
        world = self.parallel_config.world_size
        usage = [WorkerUsage(rank=r) for r in range(world)]
        try:
            results = self.collective_rpc(worker_usage, timeout=10, return_exceptions=True)
        except EngineShutdownError as e:  # not a failure: nobody is running
            results = [e] * world
            usage = [WorkerUsage(rank=r, error="shut down") for r in range(world)]
        except Exception as e:  # the executor failed: no worker answers
            results = [e] * world
        for rank, result in enumerate(results):
            w = usage[rank]
            if isinstance(result, BaseException):
                first_line = (str(result).splitlines() or [""])[0]
                w.error = w.error or f"{type(result).__name__}: {first_line}"
                continue
            w.pid, w.rss_bytes = result["pid"], result["rss_bytes"]
            w.kv_cache_bytes = result["kv_cache_bytes"]
            if result["age_s"] is not None:
                w.cpu_percent = self.metrics.cpu_percent(rank, result["pid"], result["cpu_s"],
                                                         result["age_s"])
        m = self.metrics.snapshot(usage, world, self.cache_config.num_gpu_blocks,
                                  self.is_sleeping, self.sleeping_tags)
        m.workers_failed = 0 if self._is_shutdown else world - m.workers_active
        return m.to_dict()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache on every worker (level 1; on an accelerator the weights also move
        to host memory), or the KV cache and the weights (level 2). execute_model raises
        EngineSleepingError until wake_up(). Call it with no request in flight (their KV cache
        is lost). Sleeping again is a no-op."""
        if level not in (1, 2):
            raise ConfigurationError(f"level: sleep level must be 1 or 2, got {level!r}")
        if self.is_sleeping:
            logger.info("sleep(%s): the executor is already asleep", level)
            return
        start = time.perf_counter()
        # Asleep from here on, even if a rank fails: wake_up() restores what each rank freed,
        # and a restart puts the new workers to sleep at this level.
        self.is_sleeping, self.sleeping_tags, self.sleep_level = True, \
            {"weights", "kv_cache"}, level
        self.kv_cache_epoch += 1  # the KV content is gone, whoever asked
        freed = sum(self.collective_rpc("sleep", args=(level,)))
        logger.info("asleep (level %d) in %.2f s: %.1f MiB freed", level,
                    time.perf_counter() - start, freed / (1 << 20))

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Restore "weights", "kv_cache" or both (None) on every worker; level-2 weights are
        loaded again from the checkpoint. Waking what is awake is a no-op."""
        wanted = {"weights", "kv_cache"} if tags is None else set(tags)
        unknown = wanted - {"weights", "kv_cache"}
        if unknown:
            raise ConfigurationError(f"tags: {sorted(unknown)} are not 'weights' or "
                                     "'kv_cache'")
        wake = sorted(wanted & self.sleeping_tags)
        if not wake:
            return
        start = time.perf_counter()
        self.collective_rpc("wake_up", args=(wake,))
        self.sleeping_tags -= set(wake)
        self.is_sleeping = bool(self.sleeping_tags)
        if not self.is_sleeping:
            self.sleep_level = 0
        logger.info("woke %s in %.2f s", ", ".join(wake), time.perf_counter() - start)

    def save_sharded_state(self, path: str | os.PathLike, pattern: str | None = None,
                           max_size: int | None = None) -> None:
        """Every rank writes its own tensors to `path` (`pattern`, default
        model-rank-{rank}-part-{part}.safetensors; a new part past `max_size` bytes), rank 0
        the checkpoint's config and tokenizer files, then this writes the layout description.
        Load it with LLM(path, load_format="sharded_state") and the same tensor_parallel_size
        and pipeline_parallel_size."""
        from fleetllm.model.sharded_state import check_save_args, write_metadata

        if "weights" in self.sleeping_tags:
            raise EngineSleepingError("save_sharded_state: the weights are asleep; "
                                      "wake_up(['weights']) first")
        path = os.fspath(path)
        pattern = check_save_args(path, pattern, max_size, self.model_config.model)
        os.makedirs(path, exist_ok=True)
        files = self.collective_rpc("save_sharded_state", args=(path, pattern, max_size))
        write_metadata(path, self.config, pattern, files)


def _track_execute_model(impl: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(impl)
    def execute_model(self: Executor, execute_model_req: ExecuteModelRequest) -> Any:
        if self._in_execute_model:  # a subclass calling super(): count once
            return impl(self, execute_model_req)
        if self.is_sleeping:
            raise EngineSleepingError(
                f"the engine is asleep ({', '.join(sorted(self.sleeping_tags))} freed): call "
                "wake_up() first (LLM.wake_up / LLMEngine.wake_up); an LLMEngine keeps its "
                "queued requests and runs them after wake_up")
        with self._exclusive():
            self._raise_if_unusable()
            self._in_execute_model = True
            self._step_started = time.monotonic()  # for check_health
            start = time.perf_counter()
            try:
                output = impl(self, execute_model_req)
            except BaseException:
                self.metrics.record_error()
                raise
            finally:
                self._in_execute_model = False
                if not self.step_outstanding:  # else it still runs: see check_health
                    self._step_started = None
        try:
            self._record_step(time.perf_counter() - start, execute_model_req, output)
        except Exception:  # metrics must never fail a step
            logger.exception("recording execute_model metrics failed")
        return output

    execute_model._fleetllm_tracked = True  # type: ignore[attr-defined]
    return execute_model


ExecutorBase = Executor
