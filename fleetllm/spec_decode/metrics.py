"""SpecDecodeWorkerMetrics: speculative decoding's counts (vLLM's names), per step in
SamplerOutput.spec_decode_worker_metrics and summed by the engine for its metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SpecDecodeWorkerMetrics:
    """One step's (or, summed, a run's) speculation counts; vLLM's names."""

    num_spec_tokens: int  # num_speculative_tokens: the most drafted per sequence and step
    draft_tokens: int = 0  # tokens proposed
    accepted_tokens: int = 0  # proposed tokens the target drew too
    emitted_tokens: int = 0  # tokens emitted by sequences that had drafts (accepted + 1 each)
    spec_sequences: int = 0  # sequence-steps that had drafts

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def system_efficiency(self) -> float:
        """Emitted tokens over the most the drafted sequence-steps could emit (k + 1 each)."""
        most = self.spec_sequences * (self.num_spec_tokens + 1)
        return self.emitted_tokens / most if most else 0.0

    def add(self, other: SpecDecodeWorkerMetrics) -> None:
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.emitted_tokens += other.emitted_tokens
        self.spec_sequences += other.spec_sequences

    def to_dict(self) -> dict[str, Any]:
        return {"num_spec_tokens": self.num_spec_tokens, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "emitted_tokens": self.emitted_tokens,
                "draft_acceptance_rate": self.draft_acceptance_rate,
                "system_efficiency": self.system_efficiency}
