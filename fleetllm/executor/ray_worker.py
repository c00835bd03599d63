"""RayWorkerWrapper: one rank of the "ray" backend, run as a Ray actor (see ray_executor.py).

It is the WorkerWrapperBase every backend uses, plus what only an actor needs: where it runs
(get_node_info), a free port for the rank-0 rendezvous, and a step entry point that reports an
error with whether this rank had entered a collective, as the mp worker loop does: the driver
needs that to decide whether the ranks are still in step (executor/failures.py).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from fleetllm.config import EngineConfig
from fleetllm.distributed import parallel_state
from fleetllm.executor.failures import error_payload
from fleetllm.executor.kv_output import kv_connector_news
from fleetllm.worker.delta import DeltaDesync, EncodedRequest
from fleetllm.worker.worker_base import WorkerWrapperBase

# execute_model_step's statuses
STEP_OK, STEP_RESYNC, STEP_ERR = "ok", "resync", "err"


class RayWorkerWrapper(WorkerWrapperBase):
    """Created with ray.remote(concurrency_groups={"control": 1})(RayWorkerWrapper)
    .options(...).remote(config, cpus). Ray runs the default group's methods one at a time,
    on one thread; interrupt() alone runs in the "control" group, beside them."""

    def __init__(self, config: EngineConfig, cpus: float) -> None:
        super().__init__(config, rpc_rank=-1)  # the rank comes with init_worker
        import torch

        # The bundle's CPUs are this worker's share of its node (Ray sets OMP_NUM_THREADS
        # likewise); a fractional share still needs one thread.
        torch.set_num_threads(max(1, int(cpus)))

    def get_node_info(self) -> dict[str, Any]:
        """Where this actor runs: {node_id, node_ip, gpu_ids, status, pid}. status: created
        (no worker yet), initialized (worker built), loaded (model loaded) or ready (KV cache
        allocated)."""
        import ray

        worker = self.worker
        if worker is None:
            status = "created"
        elif getattr(worker, "model_runner", None) is None:
            status = "initialized"
        elif getattr(worker, "cache_engine", None) is None:
            status = "loaded"
        else:
            status = "ready"
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "status": status, "pid": os.getpid()}

    def set_visible_gpus(self, gpu_ids: list[str]) -> None:
        """CUDA: see every GPU the executor's workers hold on this node (before CUDA starts),
        so that local_rank indexes them and NCCL can use peer access between them."""
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)

    def find_free_port(self) -> int:
        """A TCP port free on this node now, for the torch.distributed store of rank 0."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def interrupt(self) -> None:
        """Executor.interrupt_step: called in the "control" concurrency group, on a thread
        of its own, while execute_model_step may be running on the default one."""
        self.interrupts.bump()

    def execute_model_step(self, request: EncodedRequest | Any, reply: bool
                           ) -> tuple[str, Any]:
        """One step: (STEP_OK, output, or None when not `reply`), (STEP_RESYNC, None) when the
        delta cache does not match (nothing ran), or (STEP_ERR, (error payload, whether this
        rank entered a collective during the call)). Never raises: Ray would keep the
        exception but not the collective count."""
        before = parallel_state.collective_count()
        try:
            output = self.execute_model(request)
        except DeltaDesync:
            return STEP_RESYNC, None
        except BaseException as e:  # reported to the driver, which decides
            return STEP_ERR, (error_payload(e), parallel_state.collective_count() != before)
        return STEP_OK, output if reply else kv_connector_news(output)
