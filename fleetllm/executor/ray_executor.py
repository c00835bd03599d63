"""RayDistributedExecutor ("ray"): the same model across machines, one Ray actor per rank.

When one host is not enough, fleetllm runs on Ray rather than on a home-made cluster manager.
Select it with distributed_executor_backend="ray" (CLI: --distributed-executor-backend ray);
Ray is an extra: `pip install 'fleetllm[ray]'`. docs/ray.md covers running on real machines.

Cluster (ray_utils.RayConnection): a Ray connection this process already has is used as it is;
otherwise the executor joins ParallelConfig.ray_address or $RAY_ADDRESS, or else starts a
private local instance (no dashboard, loopback only). It shuts down only what it started, when
the last executor using it does.

Placement (ray_utils.placement_group_for): one bundle per worker ({CPU: ray_cpus_per_worker},
or {GPU: 1} on CUDA) in a placement group of placement_strategy (PACK, SPREAD, STRICT_PACK,
STRICT_SPREAD), or the first bundles of a group the user passes in (placement_group, to sit
beside other Ray work). Waiting for resources ends at startup_timeout with a message naming
what is missing. One RayWorkerWrapper actor (ray_worker.py: a WorkerWrapperBase, as mp's
processes use) per bundle. Ranks are assigned once the actors report their nodes, so that each
tensor-parallel group stays on one node where possible (ray_utils.assign_ranks).
torch.distributed meets at tcp://<rank 0's node address>:<a port free there> (torch's
TCPStore listens on all of that node's interfaces); gloo/NCCL use the interface each node's
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME names (a local instance started here pins them to
loopback).

Steps: the driver submits every step to every rank through Ray (as vLLM's SPMD Ray workers do).
Requests are delta encoded (fleetllm.worker.delta; the actors decode in WorkerWrapperBase), so a
decode step sends O(batch) bytes; only the output rank (parallel_state.output_rank) returns its
SamplerOutput, the others a tiny status. There is no worker "execution loop" in which ranks wait
for the next step inside a torch.distributed broadcast, as in vLLM's non-SPMD mode: requests
(pickles) would then cross gloo, which authenticates nothing, besides Ray; idle workers would
sit in a collective that times out; and a rank's error would not reach the driver by itself.
So _driver_execute_model runs one step on every rank, and stop_remote_worker_execution_loop
only waits for tasks that _run_workers(async_run_tensor_parallel_workers_only=True) started.

Failure handling follows the mp backend (executor/failures.py):
- A dead actor (killed, OOM, node lost) surfaces as Ray's RayActorError on its pending call:
  the call raises WorkerCrashedError naming the rank and its node, the other actors are killed
  and every later call raises the same error.
- collective_rpc(timeout=s) raises CommunicationTimeoutError naming the silent ranks (their
  late results are dropped with their ObjectRefs; the executor stays usable).
- execute_model: an exception on any rank fails the executor (actors killed, placement group
  removed, WorkerCrashedError naming the first rank, the remote error as __cause__) unless every
  rank raised the same error before any collective; no reply within execute_model_timeout
  raises CommunicationTimeoutError and fails it likewise. A rank failing (inside a collective,
  say) is often the symptom of a peer that died: while ranks are still out, the driver waits
  up to DEATH_WAIT_S for Ray to report a death, and then names the dead rank instead.
- After shutdown() calls raise EngineShutdownError. shutdown(), garbage collection and
  interpreter exit kill the actors and remove the placement group (ray_group.RayWorkerGroup);
  if the driver process dies, Ray itself ends the job's actors and placement groups.
"""

from __future__ import annotations

import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

from fleetllm.errors import (
    CommunicationTimeoutError,
    EngineShutdownError,
    WorkerCrashedError,
    remote_error,
)
from fleetllm.executor.abstract import Executor, RpcMethod
from fleetllm.executor.failures import (
    ERROR_GRACE_S,
    EXEC_ERROR_GRACE_S,
    load_error,
    out_of_step,
    pending_ranks,
    step_failed_error,
    step_outstanding_message,
    step_timeout_message,
)
from fleetllm.executor.ray_group import RayWorkerGroup
from fleetllm.executor.ray_utils import (
    RayConnection,
    assign_ranks,
    bundle_for,
    import_ray,
    local_ranks,
    placement_group_for,
    wait_some,
)
from fleetllm.executor.ray_worker import STEP_OK, STEP_RESYNC, RayWorkerWrapper
from fleetllm.sequence import ExecuteModelRequest, SamplerOutput
from fleetllm.worker.delta import DeltaEncoder

DEATH_WAIT_S = 1.0  # a step failed inside a collective: how long to wait for a peer's death


class _Resync(Exception):
    """Workers could not decode a delta-encoded request: send it again in full."""


def _name(method: RpcMethod) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", "callable")


class RayDistributedExecutor(Executor):
    uses_ray = True
    supports_pp = True
    delta_encoding = True  # set False (class or instance) to send full requests every step

    def _init_executor(self) -> None:
        self._ray = ray = import_ray()
        self.world_size = self.parallel_config.world_size
        self._encoder = DeltaEncoder()
        self._failure: WorkerCrashedError | None = None
        self._timed_out_step = None  # (pending, done, result): see failures.py
        self.parallel_worker_tasks: list[Any] | None = None  # vLLM's name for async tasks
        self._task_ranks: dict[Any, int] = {}
        self._group = group = RayWorkerGroup(ray, f"fleetllm-{uuid.uuid4().hex[:8]}")
        self._finalizer = weakref.finalize(self, group.close)
        try:
            self._start_workers()
        except BaseException:
            self._finalizer()
            raise

    # ------------------------------------------------------------------------------ startup

    @property
    def workers(self) -> list[Any]:
        """The RayWorkerWrapper actor handles, in rank order."""
        return list(self._group.actors)

    @property
    def placement_group(self) -> Any:
        return self._group.pg

    @property
    def node_info(self) -> list[dict[str, Any]]:
        """Where each rank runs: its get_node_info() from startup (status then: "created";
        ray.get(worker.get_node_info.remote()) on `workers` tells the current one)."""
        return [dict(n) for n in self._group.nodes]

    def _start_workers(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, pc, g = self._ray, self.parallel_config, self._group
        deadline = time.monotonic() + pc.startup_timeout
        bundle = bundle_for(self.config)
        g.connect(pc.ray_address, local_cpus=self.world_size * bundle.get("CPU", 0.0))
        g.pg, g.owns_pg = placement_group_for(ray, self.config, g.name, deadline)
        actor_cls = ray.remote(RayWorkerWrapper)
        for i in range(self.world_size):
            where = PlacementGroupSchedulingStrategy(
                placement_group=g.pg, placement_group_bundle_index=i,
                placement_group_capture_child_tasks=True)
            g.actors.append(actor_cls.options(
                num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0),
                scheduling_strategy=where, name=f"{g.name}-bundle{i}", max_restarts=0,
            ).remote(self.config, bundle.get("CPU", 1.0)))
        infos = self._startup_call(lambda a, r: a.get_node_info.remote(), deadline)
        order = assign_ranks([info["node_id"] for info in infos], pc.tensor_parallel_size)
        g.actors, g.nodes = [g.actors[i] for i in order], [infos[i] for i in order]
        local = self._local_ranks(deadline)
        ip = g.nodes[0]["node_ip"]
        port = self._startup_call(lambda a, r: a.find_free_port.remote(), deadline, [0])[0]
        init_method = f"tcp://{f'[{ip}]' if ':' in ip else ip}:{port}"
        self._startup_call(lambda a, r: a.init_worker.remote(
            local_rank=local[r], rank=r, distributed_init_method=init_method,
            is_driver_worker=r == 0), deadline)
        for method in ("init_device", "load_model"):
            self._startup_call(lambda a, r, m=method: a.execute_method.remote(m), deadline)

    def _local_ranks(self, deadline: float) -> list[int]:
        """Each rank's device index on its node. CUDA: every actor sees the GPUs our actors
        hold on its node (Ray shows each only its own), in id order, and indexes its own."""
        g = self._group
        node_ids = [n["node_id"] for n in g.nodes]
        if self.device_config.device != "cuda":
            return local_ranks(node_ids)
        gpus: dict[str, list[str]] = {}
        for n in g.nodes:
            gpus.setdefault(n["node_id"], []).extend(n["gpu_ids"])
        for ids in gpus.values():
            ids.sort(key=lambda x: (len(x), x))
        self._startup_call(lambda a, r: a.set_visible_gpus.remote(gpus[node_ids[r]]), deadline)
        return [gpus[n["node_id"]].index(n["gpu_ids"][0]) for n in g.nodes]

    def _startup_call(self, submit: Callable[..., Any], deadline: float,
                      ranks: list[int] | None = None) -> list[Any]:
        """submit(actor, rank) -> ObjectRef on each rank; the results, or the first error as
        the rank's remote error, or CommunicationTimeoutError at the startup deadline."""
        ranks = list(range(len(self._group.actors))) if ranks is None else ranks
        refs = [submit(self._group.actors[r], r) for r in ranks]

        def too_late(missing: list[int]) -> str:
            return (f"worker ranks {missing} did not finish starting (actor start, "
                    "init_device, load_model) within startup_timeout="
                    f"{self.parallel_config.startup_timeout}s")

        return self._gather(refs, ranks, deadline, False, too_late, "(during worker startup)\n")

    # ------------------------------------------------------------------------------ calls

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
        """Give up on the workers: kill them (one waiting in a collective cannot be told to
        stop), remove the placement group; every later call raises `error`."""
        self._encoder.need_reset = True
        if self._failure is None:
            self._failure = error
        self._group.stop_workers()

    def _crashed(self, rank: int, cause: BaseException) -> NoReturn:
        if self._is_shutdown:  # shutdown() killed the actors under a call in another thread
            raise EngineShutdownError("the executor was shut down during this call") from cause
        node = self._group.nodes[rank] if rank < len(self._group.nodes) else {}
        where = f" on node {node['node_ip']} (id {node['node_id'][:12]})" if node else ""
        what = str(cause).strip().splitlines()
        error = WorkerCrashedError(
            f"worker rank {rank} (Ray actor{where}) died: {what[0] if what else cause!r}; "
            "every worker was stopped and the executor is unusable: create a new one",
            rank=rank)
        self._fail(error)
        raise error from cause

    def _gather(self, refs: list[Any], ranks: list[int], deadline: float | None,
                return_exceptions: bool, too_late: Callable[[list[int]], str],
                context: str = "") -> list[Any]:
        """Results of one call per rank, in `ranks` order (see collective_rpc)."""
        pending = dict(zip(refs, ranks, strict=True))
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        error_deadline = None
        while pending:
            now = time.monotonic()
            ends = [t for t in (deadline, error_deadline) if t is not None]
            if ends and min(ends) <= now:
                break
            left = min(ends) - now if ends else None
            for rank, kind, value in wait_some(self._ray, pending, left):
                if kind == "dead":
                    self._crashed(rank, value)
                if kind == "ok":
                    results[rank] = value
                else:
                    exc, tb = value
                    errors[rank] = remote_error(rank, exc, context + tb)
            if errors and not return_exceptions and error_deadline is None:
                error_deadline = time.monotonic() + ERROR_GRACE_S
        if errors and not return_exceptions:
            raise errors[min(errors)]
        missing = [r for r in ranks if r not in results and r not in errors]
        if missing:
            raise CommunicationTimeoutError(too_late(missing))
        return [errors.get(r, results.get(r)) for r in ranks]

    def collective_rpc(self, method: RpcMethod, timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None,
                       return_exceptions: bool = False) -> list[Any]:
        # The timeout covers waiting for a step in progress too.
        with self._exclusive(timeout):
            self._raise_if_unusable()
            ranks = list(range(self.world_size))
            refs = [a.execute_method.remote(method, *args, **(kwargs or {}))
                    for a in self._group.actors]
            deadline = None if timeout is None else time.monotonic() + timeout
            return self._gather(refs, ranks, deadline, return_exceptions, lambda missing: (
                f"collective_rpc({_name(method)!r}) got no reply from worker ranks {missing} "
                f"within timeout={timeout}s"))

    def _run_workers(self, method: RpcMethod, *args: Any,
                     async_run_tensor_parallel_workers_only: bool = False,
                     all_args: list[tuple] | None = None,
                     all_kwargs: list[dict[str, Any]] | None = None,
                     use_dummy_driver: bool = False, max_concurrent_workers: int | None = None,
                     **kwargs: Any) -> list[Any]:
        """vLLM's form of collective_rpc: `method` on every rank, results in rank order;
        all_args / all_kwargs give each rank its own (indexed by rank). With
        async_run_tensor_parallel_workers_only, only the ranks that are not tensor rank 0 run
        it, and their ObjectRefs are returned at once (kept in parallel_worker_tasks until
        stop_remote_worker_execution_loop). max_concurrent_workers: run on that many ranks at
        a time (e.g. to bound the memory of simultaneous load_model calls). use_dummy_driver
        changes nothing here: every rank, rank 0 included, is an actor."""
        del use_dummy_driver
        with self._exclusive():
            self._raise_if_unusable()
            tp = self.parallel_config.tensor_parallel_size
            ranks = [r for r in range(self.world_size)
                     if not async_run_tensor_parallel_workers_only or r % tp != 0]

            def submit(r: int) -> Any:
                a = all_args[r] if all_args is not None else args
                k = all_kwargs[r] if all_kwargs is not None else kwargs
                return self._group.actors[r].execute_method.remote(method, *a, **k)

            if async_run_tensor_parallel_workers_only:
                refs = [submit(r) for r in ranks]
                self._task_ranks.update(zip(refs, ranks, strict=True))
                self.parallel_worker_tasks = (self.parallel_worker_tasks or []) + refs
                return refs
            step = max_concurrent_workers or len(ranks) or 1
            results: list[Any] = []
            for i in range(0, len(ranks), step):
                batch = ranks[i:i + step]
                results += self._gather([submit(r) for r in batch], batch, None, False,
                                        lambda missing: f"ranks {missing} did not reply")
            return results

    def stop_remote_worker_execution_loop(self) -> None:
        """Wait for the tasks _run_workers(async_run_tensor_parallel_workers_only=True)
        started, raising their errors; afterwards no worker is busy. (No rank waits in an
        execution loop between steps here: see the module docstring.)"""
        with self._exclusive():
            tasks, self.parallel_worker_tasks = self.parallel_worker_tasks, None
            if not tasks:
                return
            ranks = [self._task_ranks.pop(t) for t in tasks]
            self._gather(tasks, ranks, None, False, lambda missing: f"ranks {missing}")

    # ------------------------------------------------------------------------------ steps

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> list[SamplerOutput]:
        return self._driver_execute_model(execute_model_req)

    def _driver_execute_model(self, execute_model_req: ExecuteModelRequest | None
                              ) -> list[SamplerOutput] | None:
        """One step on every rank; the output rank's result. None: the stop signal of vLLM's
        API (stop_remote_worker_execution_loop), returns None."""
        if execute_model_req is None:
            self.stop_remote_worker_execution_loop()
            return None
        with self._exclusive():
            if self._timed_out_step is not None:  # not waited for: give up on the workers
                try:
                    self._give_up_timed_out_step(pending_ranks(self._timed_out_step[1]))
                except CommunicationTimeoutError:
                    pass
            self._raise_if_unusable()
            if not self.delta_encoding:
                return self._step(execute_model_req)
            try:
                try:
                    return self._step(self._encoder.encode(execute_model_req))
                except _Resync:
                    return self._step(self._encoder.encode(execute_model_req, full=True))
            except BaseException:  # the workers may hold part of this step: resend in full
                self._encoder.need_reset = True
                raise

    def _step(self, request: Any) -> list[SamplerOutput]:
        """Run one (maybe encoded) request on every rank; apply failures.py's rules."""
        out = self.output_rank
        pending = {a.execute_model_step.remote(request, r == out): r
                   for r, a in enumerate(self._group.actors)}
        return self._await_step(pending, [False] * self.world_size, None, first_wait=True)

    def _wait_timed_out_step(self) -> list[SamplerOutput]:
        pending, done, result = self._timed_out_step
        self._timed_out_step = None
        try:
            return self._await_step(pending, done, result, first_wait=False)
        except BaseException:
            self._encoder.need_reset = True
            raise

    def _await_step(self, pending: dict[Any, int], done: list[bool], result: Any,
                    first_wait: bool) -> list[SamplerOutput]:
        out, n = self.output_rank, self.world_size
        timeout = self.parallel_config.execute_model_timeout
        deadline = time.monotonic() + timeout
        resync = False
        errors: dict[int, BaseException] = {}  # in order of arrival
        info: dict[int, tuple[str, str, bool]] = {}  # (type, message, entered a collective)
        error_deadline = None
        while pending:
            now = time.monotonic()
            end = deadline if error_deadline is None else min(deadline, error_deadline)
            if end <= now:
                break
            for rank, kind, value in wait_some(self._ray, pending, end - now):
                done[rank] = True
                if kind == "dead":
                    self._crashed(rank, value)
                if kind == "error":  # Ray failed the call itself (e.g. an unpicklable result):
                    errors[rank] = remote_error(rank, *value)  # where it stood is unknown
                    info[rank] = (type(value[0]).__name__, str(value[0]), True)
                    continue
                status, payload = value
                if status == STEP_OK:
                    result = payload if rank == out else result
                elif status == STEP_RESYNC:
                    resync = True
                else:
                    err, entered = payload
                    exc, tb = load_error(err)
                    errors[rank] = remote_error(rank, exc, tb)
                    info[rank] = (err[1], err[2], entered)
            if errors and not resync and error_deadline is None:
                error_deadline = time.monotonic() + EXEC_ERROR_GRACE_S
            reason = out_of_step(info, done) if errors else None
            if reason is not None:
                self._step_failed(errors, reason, pending)
        missing = [r for r in range(n) if not done[r]]
        if errors and missing:
            self._step_failed(errors, f"while ranks {missing} did not report the same error "
                                      "in time (presumably waiting in a collective operation)",
                              pending)
        if resync and not missing:
            raise _Resync()
        if errors:  # every rank, the same error, before any collective: still in step
            raise errors[min(errors)]
        if missing and first_wait:  # failures.py: the caller may wait once more
            self._timed_out_step = (pending, done, result)
            raise CommunicationTimeoutError(step_outstanding_message(missing, timeout))
        if missing:
            self._give_up_timed_out_step(missing)
        return result

    def _give_up_timed_out_step(self, missing: list[int]) -> NoReturn:
        self._timed_out_step = None
        what = step_timeout_message(missing, self.parallel_config.execute_model_timeout)
        self._fail(WorkerCrashedError(f"{what}, twice; the workers were stopped and the "
                                      "executor is unusable: create a new one",
                                      rank=missing[0] if len(missing) == 1 else None))
        raise CommunicationTimeoutError(f"{what}, twice: the workers are hung; every worker "
                                        "was stopped, the executor is unusable")

    def _step_failed(self, errors: dict[int, BaseException], reason: str,
                     pending: dict[Any, int]) -> NoReturn:
        """The step failed with the ranks possibly out of step. A failure inside a collective
        is often a peer's death (gloo sees the connection close before Ray reports the actor
        dead): if a rank still out dies within DEATH_WAIT_S, that is the error to report."""
        if pending:
            end = time.monotonic() + DEATH_WAIT_S
            while pending and time.monotonic() < end:
                for rank, kind, value in wait_some(self._ray, pending, end - time.monotonic()):
                    if kind == "dead":
                        self._crashed(rank, value)
        rank, remote = next(iter(errors.items()))
        error = step_failed_error(rank, remote, reason)
        self._fail(error)
        raise error from remote

    def restart_failed_workers(self) -> None:
        """As the base class does, holding this process's Ray connection meanwhile: closing
        the old group would otherwise stop a local Ray instance only to start it again."""
        held = RayConnection.acquire(self._ray, self.parallel_config.ray_address, 0.0)
        try:
            super().restart_failed_workers()
        finally:
            if held:
                RayConnection.release(self._ray)

    def _shutdown(self) -> None:
        self._finalizer()  # runs group.close() once; a call in progress ends with its actors
