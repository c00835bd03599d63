"""UniProcExecutor: the single driver worker runs in this process."""

from __future__ import annotations

import threading
import traceback
from typing import Any

from fleetllm.errors import (
    CommunicationTimeoutError,
    EngineShutdownError,
    as_out_of_memory,
    remote_error,
)
from fleetllm.executor.abstract import Executor, RpcMethod
from fleetllm.worker.worker_base import WorkerWrapperBase, run_method


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.driver_worker = WorkerWrapperBase(self.config, rpc_rank=0)
        self.driver_worker.init_worker(local_rank=0, rank=0, distributed_init_method=None,
                                       is_driver_worker=True)
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def collective_rpc(self, method: RpcMethod, timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None,
                       return_exceptions: bool = False) -> list[Any]:
        if self._is_shutdown:  # the worker has freed its cache: say so, not what broke
            raise EngineShutdownError("the executor was shut down; create a new LLM (or "
                                      "executor) to run the model again")
        with self.access.exclusive(timeout):
            self._raise_if_unusable()
            worker = self.driver_worker.worker
            try:
                if timeout is None:
                    return [run_method(worker, method, args, kwargs or {})]
                return [_call_with_timeout(worker, method, args, kwargs or {}, timeout)]
            except CommunicationTimeoutError:
                raise
            except Exception as e:
                err = remote_error(0, as_out_of_memory(e), traceback.format_exc())
                if return_exceptions:
                    return [err]
                raise err from e

    def interrupt_step(self) -> None:
        self.driver_worker.interrupts.bump()  # this process's memory: read between passes

    def _shutdown(self) -> None:
        worker = getattr(self.driver_worker, "worker", None)
        if worker is not None:
            worker.shutdown()


def _call_with_timeout(worker: Any, method: RpcMethod, args: tuple, kwargs: dict,
                       timeout: float) -> Any:
    """Run the call on a helper thread so the caller can give up after `timeout` seconds.

    Python cannot interrupt a running call in-process: a timed-out call keeps running on its
    daemon thread. The multiprocess backends can do better (the worker is another process).
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = run_method(worker, method, args, kwargs)
        except BaseException as e:  # re-raised in the caller, its traceback intact
            box["error"] = e

    thread = threading.Thread(target=target, name="fleetllm-rpc", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        name = method if isinstance(method, str) else getattr(method, "__name__", "callable")
        raise CommunicationTimeoutError(f"collective_rpc({name!r}) did not return within "
                                        f"{timeout}s on rank 0")
    if "error" in box:
        raise box["error"]
    return box["result"]
