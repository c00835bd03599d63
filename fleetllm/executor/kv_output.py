"""KVOutputAggregator: one KVConnectorOutput per step from every rank's (vLLM's name).

With a KV connector every rank returns its KVConnectorOutput, the output rank on its step
result and the others alone (`kv_connector_news`: mp and ray send only that from a rank that
does not sample). A request's send (receive) is finished when the LAST rank has reported it:
ranks may report it in different steps, so the aggregator counts reports per request across
steps and emits the request once, in the step its count reaches world_size. Failed loads
(invalid_block_ids) are the union over ranks: a block is unusable if any rank's shard of it is.
A rank that reports nothing in a step (None) simply adds nothing. Counters
(kv_connector_stats) are summed.
"""

from __future__ import annotations

from typing import Any

from fleetllm.sequence import KVConnectorOutput, SamplerOutput


def kv_connector_news(result: Any) -> KVConnectorOutput | None:
    """A non-output rank's reply to a step: its KVConnectorOutput, or None (no connector)."""
    if isinstance(result, list) and result and isinstance(result[-1], SamplerOutput):
        return result[-1].kv_connector_output
    return None


class KVOutputAggregator:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._sending: dict[str, int] = {}  # request id -> ranks still to report
        self._recving: dict[str, int] = {}

    def _count(self, pending: dict[str, int], ids: set[str] | None) -> None:
        for rid in ids or ():
            pending[rid] = pending.get(rid, self.world_size) - 1

    @staticmethod
    def _done(pending: dict[str, int]) -> set[str] | None:
        done = {rid for rid, left in pending.items() if left <= 0}
        for rid in done:
            del pending[rid]
        return done or None

    def aggregate(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput:
        """Merge one step's per-rank outputs (in rank order; None: nothing from that rank)."""
        invalid: set[int] = set()
        stats: dict[str, int] = {}
        for out in outputs:
            if out is None:
                continue
            self._count(self._sending, out.finished_sending)
            self._count(self._recving, out.finished_recving)
            invalid |= out.invalid_block_ids
            for name, value in (out.kv_connector_stats or {}).items():
                stats[name] = stats.get(name, 0) + value
        return KVConnectorOutput(self._done(self._sending), self._done(self._recving), invalid,
                                 stats or None)

    def merge_step(self, results: list[Any], output_rank: int) -> list[SamplerOutput]:
        """The output rank's step result, its last SamplerOutput carrying the merged
        KVConnectorOutput of every rank's `results` (the executor's per-rank replies)."""
        merged = self.aggregate([r if isinstance(r, KVConnectorOutput) or r is None
                                 else kv_connector_news(r) for r in results])
        output = results[output_rank]
        output[-1].kv_connector_output = merged
        return output
