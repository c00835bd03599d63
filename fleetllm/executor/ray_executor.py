"""RayDistributedExecutor ("ray", the `fleetllm[ray]` extra): the model across machines, one
Ray actor (RayWorkerWrapper) per rank; docs/distributed.md covers real clusters.

How: the process's Ray connection, else ray_address / $RAY_ADDRESS, else a private loopback
instance (ray_utils.RayConnection). One placement-group bundle per worker; ranks are assigned
once actors report their nodes, a TP group on one node where possible. Every step goes to
every rank through Ray (SPMD, delta encoded), never a gloo broadcast, which authenticates
nothing; only the output rank returns its SamplerOutput.
What fails: waiting for resources ends at startup_timeout naming what is missing; a dead
actor is a WorkerCrashedError naming rank and node; the rest follows distributed.py.
shutdown, GC and exit kill the actors and the placement group; if the driver dies, Ray does.
"""

from __future__ import annotations

import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from fleetllm.errors import WorkerCrashedError, remote_error
from fleetllm.executor.abstract import RpcMethod
from fleetllm.executor.distributed import ERR, OK, RESYNC, DistributedExecutor, Reply
from fleetllm.executor.failures import load_error
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

DEATH_WAIT_S = 1.0  # a step failed inside a collective: how long to wait for a peer's death


@dataclass
class _RayCall:
    """One call in flight: ObjectRef -> rank for the replies still out."""

    pending: dict[Any, int]
    step: bool = False
    context: str = ""  # put before a remote traceback


class RayDistributedExecutor(DistributedExecutor):
    uses_ray = True
    supports_pp = True

    def _init_executor(self) -> None:
        self._init_failure_state()
        self._ray = ray = import_ray()
        self.world_size = self.parallel_config.world_size
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
        # "control": interrupt() runs on a thread of its own, beside a step under way.
        actor_cls = ray.remote(concurrency_groups={"control": 1})(RayWorkerWrapper)
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
        call = _RayCall({submit(self._group.actors[r], r): r for r in ranks},
                        context="(during worker startup)\n")

        def too_late(missing: list[int]) -> str:
            return (f"worker ranks {missing} did not finish starting (actor start, "
                    "init_device, load_model) within startup_timeout="
                    f"{self.parallel_config.startup_timeout}s")

        return self._collect(call, deadline, False, step=False, too_late=too_late, ranks=ranks)

    # ------------------------------------------------------------------ transport and failure

    def _death(self, rank: int, cause: BaseException) -> NoReturn:
        node = self._group.nodes[rank] if rank < len(self._group.nodes) else {}
        where = f" on node {node['node_ip']} (id {node['node_id'][:12]})" if node else ""
        what = str(cause).strip().splitlines()
        self._crashed(WorkerCrashedError(
            f"worker rank {rank} (Ray actor{where}) died: {what[0] if what else cause!r}; "
            "every worker was stopped and the executor is unusable: create a new one",
            rank=rank), cause)

    def _stop_workers(self) -> None:
        self._group.stop_workers()

    def interrupt_step(self) -> None:
        actors = self._group.actors
        if len(actors) == self.world_size:  # started (no reply awaited: fire and forget)
            actors[self.output_rank].interrupt.options(concurrency_group="control").remote()

    def _send(self, method: RpcMethod, args: tuple, kwargs: dict[str, Any] | None,
              step: bool, deadline: float | None) -> _RayCall:
        actors = self._group.actors
        if step:
            out = self.output_rank
            return _RayCall({a.execute_model_step.remote(args[0], r == out): r
                             for r, a in enumerate(actors)}, step=True)
        return _RayCall({a.execute_method.remote(method, *args, **(kwargs or {})): r
                         for r, a in enumerate(actors)})

    def _replies(self, call: _RayCall, timeout: float | None) -> list[Reply]:
        replies: list[Reply] = []
        for rank, kind, value in wait_some(self._ray, call.pending, timeout):
            if kind == "dead":
                self._death(rank, value)
            if kind == "error":  # the method raised; in a step, Ray failed the call itself
                exc, tb = value  # (e.g. an unpicklable result): where it stood is unknown
                replies.append((rank, ERR, (remote_error(rank, exc, call.context + tb),
                                            type(exc).__name__, str(exc), call.step)))
            elif not call.step:
                replies.append((rank, OK, value))
            else:
                status, payload = value
                if status == STEP_OK:
                    replies.append((rank, OK, payload))
                elif status == STEP_RESYNC:
                    replies.append((rank, RESYNC, None))
                else:
                    err, entered = payload
                    exc, tb = load_error(err)
                    replies.append((rank, ERR, (remote_error(rank, exc, tb), err[1], err[2],
                                                entered)))
        return replies

    def _await_deaths(self, call: _RayCall) -> None:
        """gloo sees a peer's connection close before Ray reports the actor dead: if a rank
        still out dies within DEATH_WAIT_S, that is the error to report."""
        end = time.monotonic() + DEATH_WAIT_S
        while call.pending and time.monotonic() < end:
            for rank, kind, value in wait_some(self._ray, call.pending,
                                               end - time.monotonic()):
                if kind == "dead":
                    self._death(rank, value)

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
        with self.access.exclusive():
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
                call = _RayCall({submit(r): r for r in batch})
                results += self._collect(call, None, False, step=False, ranks=batch)
            return results

    def stop_remote_worker_execution_loop(self) -> None:
        """Wait for the tasks _run_workers(async_run_tensor_parallel_workers_only=True)
        started, raising their errors; afterwards no worker is busy. (No rank waits in an
        execution loop between steps here: see the module docstring.)"""
        with self.access.exclusive():
            tasks, self.parallel_worker_tasks = self.parallel_worker_tasks, None
            if not tasks:
                return
            ranks = [self._task_ranks.pop(t) for t in tasks]
            self._collect(_RayCall(dict(zip(tasks, ranks, strict=True))), None, False,
                          step=False, ranks=ranks)

    def _driver_execute_model(self, execute_model_req: ExecuteModelRequest | None
                              ) -> list[SamplerOutput] | None:
        """vLLM's name: one step on every rank, the output rank's result; None is the stop
        signal of vLLM's API (stop_remote_worker_execution_loop) and returns None."""
        if execute_model_req is None:
            self.stop_remote_worker_execution_loop()
            return None
        return self.execute_model(execute_model_req)

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
