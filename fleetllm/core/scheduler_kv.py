"""The Scheduler's KV-transfer part (fleetllm/kv_transfer): how many prompt tokens a waiting
group takes from the connector's store, telling the connector that a request ended, and what a
failed load does to the step (kv_load_failure_policy).

A failed load: every scheduled group holding a block a worker could not load leaves the step
before it is applied; with "recompute" it waits to be computed again from its tokens, never
asking the store again; with "fail" it ends with finish_reason "error". Its blocks are freed
without ever being registered, so none of them enters the prefix cache.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from fleetllm.core.block_manager import BlockManager
from fleetllm.core.scheduler_output import SchedulerOutputs
from fleetllm.errors import ConfigurationError
from fleetllm.sequence import SequenceGroup

if TYPE_CHECKING:
    from fleetllm.kv_transfer.base import KVConnectorBase_V1


class KVTransferMixin:
    """Needs the Scheduler's block_manager, running, waiting, kv_connector,
    kv_load_failure_policy, num_kv_load_failures, _reset_for_recompute and _ignore."""

    block_manager: BlockManager
    running: Any
    waiting: Any
    kv_connector: KVConnectorBase_V1 | None
    kv_load_failure_policy: str
    num_kv_load_failures: int
    # request id -> the kv_transfer_params the connector returned when it finished; the
    # engine moves them onto the request's final output (take_kv_transfer_params).
    finished_kv_transfer_params: dict[str, dict[str, Any]]

    def drop_failed_loads(self, out: SchedulerOutputs, invalid_block_ids: set[int]
                          ) -> tuple[list[int], list[SequenceGroup]]:
        """The step `out` ran, but the workers could not load `invalid_block_ids` from the KV
        connector's store. Each scheduled group holding one is taken out of `out` (its step
        results are garbage; call before complete_step) and, by kv_load_failure_policy,
        waits to be recomputed from its tokens without the store, or ends with
        finish_reason "error". Its blocks are freed unregistered: none enters the prefix
        cache. Returns (the indices of those groups in out.scheduled_seq_groups before the
        call, the groups that ended)."""
        bm = self.block_manager
        indices = [i for i, s in enumerate(out.scheduled_seq_groups)
                   if any(b in invalid_block_ids for seq in s.seq_group.unfinished_seqs()
                          for b in bm.block_tables.get(seq.seq_id, ()))]
        ended = []
        for i in indices:
            group = out.scheduled_seq_groups[i].seq_group
            self.num_kv_load_failures += 1
            group.kv_load_failed = True  # never asks the store again
            if group in self.running:
                self.running.remove(group)
            if self.kv_load_failure_policy == "fail":
                self._ignore(group, SchedulerOutputs(), "its KV blocks could not be loaded "
                             "from the KV connector's store (kv_load_failure_policy='fail')")
                ended.append(group)
            else:
                self._reset_for_recompute(group)
                self.waiting.append(group)
        self.waiting = deque(sorted(self.waiting, key=lambda g: g.arrival_time))
        keep = set(indices)
        out.scheduled_seq_groups = [s for i, s in enumerate(out.scheduled_seq_groups)
                                    if i not in keep]
        return indices, ended

    def _connector_finished(self, group: SequenceGroup) -> None:
        if self.kv_connector is None:
            return
        blocks = next((self.block_manager.block_tables.get(s.seq_id, []) for s in group.seqs
                       if s.seq_id in self.block_manager.block_tables), [])
        delay_free, params = self.kv_connector.request_finished(group, list(blocks))
        if params is not None:
            self.finished_kv_transfer_params[group.request_id] = params
        if delay_free:  # asynchronous sends: a later part of issue 74
            raise ConfigurationError("kv_transfer_config: the connector asked to keep a "
                                     "finished request's blocks (delay_free=True); fleetllm "
                                     "does not support asynchronous KV sends yet")

    def take_kv_transfer_params(self) -> dict[str, dict[str, Any]]:
        """The kv_transfer_params of the requests that finished since the last call."""
        params, self.finished_kv_transfer_params = self.finished_kv_transfer_params, {}
        return params

    def _external_tokens(self, group: SequenceGroup, num_hits: int) -> int:
        """Tokens past the local hit of `num_hits` blocks the KV connector's store holds (0
        without one, for a group that failed to load before, or one that started)."""
        seqs = group.unfinished_seqs()
        if self.kv_connector is None or group.kv_load_failed or \
                len(seqs) != 1 or seqs[0].data.num_computed_tokens or \
                seqs[0].seq_id in self.block_manager.block_tables:
            return 0
        tokens, is_async = self.kv_connector.get_num_new_matched_tokens(
            group, num_hits * self.block_manager.block_size)
        if is_async:
            raise ConfigurationError("kv_transfer_config: the connector loads asynchronously; "
                                     "fleetllm supports synchronous loads only so far")
        return tokens
