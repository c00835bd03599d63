"""Worker classes for fault tests (named by worker_cls, so they survive a restart, unlike
fleetllm.worker.faults, and run in mp worker processes: tests/ is on their path)."""

from __future__ import annotations

import os

import torch

from fleetllm.worker.worker import Worker

OOM_ABOVE_ENV = "FLEETLLM_TEST_OOM_ABOVE"  # "rank:tokens": steps larger than this fail
FAIL_LOAD_FLAG_ENV = "FLEETLLM_TEST_FAIL_LOAD_FLAG"  # a file: load_model fails while it exists


def _step_tokens(request) -> int:
    return sum((g.token_chunk_size or 1) * len(g.seq_data)
               for g in request.seq_group_metadata_list)


def _allocation_failure(device: torch.device) -> None:
    torch.empty(1 << 62, dtype=torch.uint8, device=device)  # the allocator itself fails


class MemoryLimitedWorker(Worker):
    """A device too small for steps of more than N tokens: on rank R such a step runs (its
    collectives included) and then fails a real allocation, as a large activation would.
    Every rank counts the failures it raised in `oom_count` (for uni: the test reads it)."""

    oom_count = 0

    def execute_model(self, execute_model_req):
        rank, limit = (int(x) for x in os.environ[OOM_ABOVE_ENV].split(":"))
        output = super().execute_model(execute_model_req)
        if self.rank == rank and _step_tokens(execute_model_req) > limit:
            type(self).oom_count += 1
            _allocation_failure(self.device)
        return output


class FailOnceLoadWorker(Worker):
    """load_model fails once after the flag file appears (it removes the flag): a restart
    that fails for a passing cause."""

    def load_model(self) -> None:
        flag = os.environ.get(FAIL_LOAD_FLAG_ENV)
        if flag and os.path.exists(flag):
            try:
                os.unlink(flag)
            except FileNotFoundError:  # another rank took it
                pass
            raise RuntimeError("load_model failed (a passing cause, injected)")
        super().load_model()
