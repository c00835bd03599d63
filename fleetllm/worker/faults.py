"""Fault injection for tests: make one rank crash, hang, raise or run out of memory at its
k-th execute_model (test-only: nothing in fleetllm installs one).

    from fleetllm.worker.faults import inject_fault
    inject_fault(llm.llm_engine.model_executor, rank=1, kind="crash", at_call=5)

Installed in the worker through `collective_rpc`, so it fires at an exact step on any backend:
"crash" SIGKILLs the worker process (not on `uni`), "hang" sleeps past any timeout (or
`seconds`), "raise" raises RuntimeError, "oom" fails a real allocation (classified as
OutOfMemoryError like a real one). Calls count from installation; restarted workers have none.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

KINDS = ("crash", "hang", "raise", "oom")


def inject_fault(executor: Any, rank: int, kind: str, at_call: int = 1,
                 seconds: float | None = None) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    executor.collective_rpc(_install, args=(rank, kind, at_call, seconds))


def _install(worker: Any, rank: int, kind: str, at_call: int, seconds: float | None) -> None:
    if worker.rank != rank:
        return
    inner = worker.execute_model
    calls = 0

    def execute_model(request: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == at_call:
            if kind == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "hang":
                time.sleep(10**6 if seconds is None else seconds)
            elif kind == "raise":
                raise RuntimeError(f"injected fault at execute_model call {calls}")
            else:  # more than any device has: the allocator itself fails
                torch.empty(1 << 62, dtype=torch.uint8, device=worker.device)
        return inner(request)

    worker.execute_model = execute_model
