"""Expert load as the engine sees it: per MoE layer, the (token, expert) pairs its router
sent to each expert since the engine started, and how uneven that is.

What: `ExpertLoad.counts()` {layer index: [pairs per expert]} (LLMEngine.expert_load()),
`imbalance()` {layer: max / mean pairs per expert} (1.0: even; E: one expert took all),
`summary(counts)` a line for the benchmarks' output.
How: the workers count (model/moe_load.py: a bincount of the router's top-k ids a step,
nothing sent in a step); `pull()` asks every rank for its counts since the last pull
(collective_rpc, 10 s timeout) and adds them here, `refresh()` at most once every
`every_s` seconds (the server's per-step snapshot, engine/stats.EngineLoad). A dense model
has no MoE layer: nothing is asked.
What fails: nothing raises: a pull that fails (a worker died: recovery replaces it, and the
counts it had not handed over are lost) or one while the executor sleeps leaves the totals
as they were; metrics never take the engine down.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fleetllm.model.moe_load import worker_expert_load

logger = logging.getLogger(__name__)


class ExpertLoad:
    def __init__(self, executor: Any, num_experts: int):
        self.executor = executor
        self.num_experts = num_experts
        self._totals: dict[int, list[int]] = {}
        self._pulled_at = float("-inf")  # time.monotonic() of the last pull

    def pull(self) -> None:
        if not self.num_experts or self.executor.is_sleeping:
            return
        self._pulled_at = time.monotonic()
        try:
            replies = self.executor.collective_rpc(worker_expert_load, timeout=10)
        except Exception as e:  # noqa: BLE001 - metrics must not fail the engine
            logger.warning("expert load: could not read the workers' counts: %s", e)
            return
        for reply in replies:
            for layer, counts in reply.items():
                total = self._totals.setdefault(int(layer), [0] * len(counts))
                for e, n in enumerate(counts):
                    total[e] += n

    def refresh(self, every_s: float = 1.0) -> None:
        if time.monotonic() - self._pulled_at >= every_s:
            self.pull()

    def counts(self) -> dict[int, list[int]]:
        return {layer: list(c) for layer, c in sorted(self._totals.items())}

    def imbalance(self) -> dict[int, float]:
        return imbalance(self._totals)


def imbalance(counts: dict[int, list[int]]) -> dict[int, float]:
    """{layer: max / mean of its experts' counts}, the layers that saw a token."""
    return {layer: max(c) * len(c) / sum(c) for layer, c in sorted(counts.items()) if sum(c)}


def summary(counts: dict[int, list[int]]) -> str | None:
    """'expert load imbalance (max/mean tokens per expert): mean 1.42 over 2 MoE layers,
    worst 1.87 (layer 3)', or None before any MoE token."""
    ratios = imbalance(counts)
    if not ratios:
        return None
    worst = max(ratios, key=ratios.__getitem__)
    return (f"expert load imbalance (max/mean tokens per expert): mean "
            f"{sum(ratios.values()) / len(ratios):.2f} over {len(ratios)} MoE layers, "
            f"worst {ratios[worst]:.2f} (layer {worst})")
