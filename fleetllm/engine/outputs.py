"""What the engine hands back to users: RequestOutput and CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass

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
