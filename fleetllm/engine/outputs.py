"""What the engine hands back to users: RequestOutput and CompletionOutput for generation;
PoolingRequestOutput (and LLM.embed/score's Embedding/ScoringRequestOutput) for pooling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetllm.sequence import Logprob, RequestMetrics, SequenceGroup


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the request was rejected, when finish_reason is "error"
    # KV transfer: what the KV connector returned for a peer when the request finished (a
    # kv_producer's answer to do_remote_decode: the decode leg sends it back); else None.
    kv_transfer_params: dict[str, Any] | None = None

    @classmethod
    def from_seq_group(cls, group: SequenceGroup) -> RequestOutput:
        want_logprobs = group.sampling_params.logprobs is not None
        outputs = [CompletionOutput(
            index=i, text=seq.visible_text, token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if want_logprobs else None,
            logprobs=list(seq.output_logprobs) if want_logprobs else None,
            finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason)
            for i, seq in enumerate(group.seqs)]
        return cls(group.request_id, group.prompt, list(group.prompt_token_ids),
                   group.prompt_logprobs, outputs, group.is_finished(), group.metrics,
                   group.error)

    @classmethod
    def rejected(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 error: str) -> RequestOutput:
        out = CompletionOutput(0, "", [], None, None, finish_reason="error")
        return cls(request_id, prompt, prompt_token_ids, None, [out], True, None, error)


# ------------------------------------------------------------------ pooling (task="embed")


@dataclass
class PoolingOutput:
    data: Any  # torch.Tensor [dim], float32 on the CPU


@dataclass
class PoolingRequestOutput:
    """One pooling request's result: `outputs.data` is its pooled (and, as configured,
    normalized and truncated) vector. A rejected request has finished=True, data None and the
    reason in `error`."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    error: str | None = None
    metrics: RequestMetrics | None = None
    prompt: str | None = None

    @property
    def finish_reason(self) -> str | None:
        """As a generated sequence's: "stop" once pooled, "error" when it was rejected or
        failed (no vector), None while it runs."""
        if not self.finished:
            return None
        return "error" if self.error is not None or self.outputs.data is None else "stop"

    @classmethod
    def from_seq_group(cls, group: SequenceGroup) -> PoolingRequestOutput:
        return cls(group.request_id, PoolingOutput(group.pooled_data),
                   list(group.prompt_token_ids), group.is_finished(), group.error,
                   group.metrics, group.prompt)

    @classmethod
    def rejected(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 error: str) -> PoolingRequestOutput:
        return cls(request_id, PoolingOutput(None), prompt_token_ids, True, error, None, prompt)


def request_output(group: SequenceGroup) -> RequestOutput | PoolingRequestOutput:
    """A request's output as its kind has it: pooled vector or generated sequences."""
    if group.pooling_params is not None:
        return PoolingRequestOutput.from_seq_group(group)
    return RequestOutput.from_seq_group(group)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's result: `outputs.embedding` is a list of floats (as in vLLM)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool
    error: str | None = None

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        data = out.outputs.data
        return cls(out.request_id, EmbeddingOutput([] if data is None else data.tolist()),
                   out.prompt_token_ids, out.finished, out.error)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """LLM.score's result: `outputs.score` is the cosine similarity of the two texts'
    embeddings."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # both texts' ids, the first's then the second's
    finished: bool = True
