"""Data contracts between the layers (plain dataclasses), and the engine's request state.

Engine -> executor -> worker: ExecuteModelRequest holding one SequenceGroupMetadata per
scheduled request. Worker -> engine: list[SamplerOutput], whose outputs are one
CompletionSequenceGroupOutput per group when generating, one PoolingSequenceGroupOutput per
group that finished its prompt when pooling (task "embed"). Keep these small and picklable: the
multiprocess and Ray executors ship them between processes.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from fleetllm.lora.request import LoRARequest
from fleetllm.pooling_params import PoolingParams
from fleetllm.sampling_params import SamplingParams


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class SequenceData:
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are already in the cache
    # Which of the request's n samples this is (0 for the first). Seeded sampling draws from
    # (seed, sample_index, position), so a recomputed or re-run sample draws the same tokens.
    sample_index: int = 0

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else \
            self.output_token_ids[position - n]

    def num_uncomputed_tokens(self) -> int:
        return self.get_len() - self.num_computed_tokens


@dataclass
class SequenceGroupMetadata:
    """One request's slice of a step. `token_chunk_size` new tokens per sequence are computed,
    starting at each sequence's num_computed_tokens; None means all uncomputed tokens. A
    non-final prefill chunk has do_sample=False. `is_prompt` is the group's stage as the
    scheduler records it (a prompt, or a recompute after preemption, until its first sampled
    step completes), never inferred from token counts: a final prefill chunk of one token is
    still a prompt step, and a fresh prompt's sampled step draws all n samples."""

    request_id: str
    is_prompt: bool
    seq_data: dict[int, SequenceData]
    sampling_params: SamplingParams
    block_tables: dict[int, list[int]]
    token_chunk_size: int | None = None
    do_sample: bool = True
    # A pooling request (task "embed"): its whole prompt runs in this step and is pooled.
    pooling_params: PoolingParams | None = None
    # Structured outputs: per sequence (in seq_data's order) the tokens its grammar allows
    # next, packed int32 [num_seqs, ceil(vocab / 32)]; None for a request without one.
    grammar_bitmask: Any = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base)


@dataclass
class ExecuteModelRequest:
    seq_group_metadata_list: list[SequenceGroupMetadata]
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)  # {cpu block: gpu block}
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)  # {gpu block: cpu block}
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)  # {src: [dst, ...]}
    num_lookahead_slots: int = 0
    running_queue_size: int | None = None
    # Requests that ended since the last step: workers drop any per-request state they keep.
    finished_requests_ids: list[str] = field(default_factory=list)
    # Multi-step decoding: forward passes the workers run in this call (a decode-only batch),
    # returning one SamplerOutput per pass.
    num_steps: int = 1
    # KV transfer (fleetllm/kv_transfer): the scheduler-side connector's plan for this step
    # (what each worker loads and saves); None without a connector.
    kv_connector_metadata: Any = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SequenceOutput:
    parent_seq_id: int
    output_token: int
    logprobs: dict[int, Logprob]


@dataclass
class CompletionSequenceGroupOutput:
    request_id: str
    samples: list[SequenceOutput]
    # For the prompt tokens computed this step: one {token: Logprob} per token (None for the
    # very first prompt token, which has no context); None when not requested.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class PoolingSequenceGroupOutput:
    request_id: str
    data: Any  # torch.Tensor [dim], float32: pooled, truncated and normalized as asked


@dataclass
class KVConnectorOutput:
    """A step's KV-transfer news from a worker (vLLM's names): requests whose asynchronous
    send / receive finished, and device blocks whose load failed. The executor's
    KVOutputAggregator merges every rank's into one (a request is finished once all ranks
    have reported it; invalid blocks are the union)."""

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] = field(default_factory=set)
    # The connector's counters of the step ({name: count}); summed over ranks.
    kv_connector_stats: dict[str, int] | None = None

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids
                    or self.kv_connector_stats)


@dataclass
class SamplerOutput:
    outputs: list[CompletionSequenceGroupOutput] | list[PoolingSequenceGroupOutput]
    sampled_token_ids: Any = None  # tensor [num_samples] when available
    sampled_token_probs: Any = None
    spec_decode_worker_metrics: Any = None
    # With a KV connector: this rank's (after the executor: all ranks') KVConnectorOutput,
    # on the last SamplerOutput of a step.
    kv_connector_output: KVConnectorOutput | None = None

    def __len__(self) -> int:
        return len(self.outputs)

    def __iter__(self) -> Iterator[CompletionSequenceGroupOutput]:
        return iter(self.outputs)

    def __getitem__(self, index: int) -> CompletionSequenceGroupOutput:
        return self.outputs[index]


# ---------------------------------------------------------------- engine-side request state


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_IGNORED = "error"  # could never be scheduled (SequenceGroup.error says why)

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


class Sequence:
    """One generated continuation of a prompt: its tokens, text and logprobs so far."""

    def __init__(self, seq_id: int, prompt: str | None, prompt_token_ids: list[int],
                 cache_salt: bytes | None = None):
        self.seq_id = seq_id
        self.prompt = prompt
        # Seeds its prefix-cache hashes: KV computed under one LoRA adapter is never found
        # by a request under another, or under the base model (None).
        self.cache_salt = cache_salt
        self.data = SequenceData(list(prompt_token_ids))
        self.status = SequenceStatus.WAITING
        self.output_text = ""
        # Characters at the end of output_text not shown yet: they could still begin a stop
        # string, and text once returned is never taken back (streaming needs that).
        self.held_back = 0
        self.output_logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.stop_reason: int | str | None = None
        # Incremental detokenization state (see engine/detokenizer.py).
        self.tokens: list[str] | None = None
        self.prefix_offset = 0
        self.read_offset = 0
        # Structured outputs: [matcher, tokens it has accepted] (StructuredOutputManager),
        # rebuilt from the output tokens whenever missing.
        self.grammar_state: list | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.data.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.data.output_token_ids

    def get_len(self) -> int:
        return self.data.get_len()

    @property
    def visible_text(self) -> str:
        """The output text that may be shown: all of it but what is held back."""
        return self.output_text[:len(self.output_text) - self.held_back]

    def append_token(self, token_id: int, logprobs: dict[int, Logprob]) -> None:
        self.data.output_token_ids.append(token_id)
        self.output_logprobs.append(logprobs)
        if token_id in logprobs:
            self.cumulative_logprob += logprobs[token_id].logprob

    def is_finished(self) -> bool:
        return self.status.finished

    def fork(self, new_seq_id: int, sample_index: int) -> Sequence:
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.seq_id = new_seq_id
        child.data = SequenceData(self.data.prompt_token_ids,
                                  list(self.data.output_token_ids),
                                  self.data.num_computed_tokens, sample_index)
        child.output_logprobs = list(self.output_logprobs)
        child.tokens = None if self.tokens is None else list(self.tokens)
        child.grammar_state = None  # a matcher is not shared: the child replays its tokens
        return child


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None


class SequenceGroup:
    """A request: the sequences sampled from one prompt (n of them once the prompt is done)."""

    def __init__(self, request_id: str, seqs: list[Sequence], sampling_params: SamplingParams,
                 arrival_time: float | None = None,
                 pooling_params: PoolingParams | None = None,
                 lora_request: LoRARequest | None = None):
        self.request_id = request_id
        self.seqs = seqs
        self.sampling_params = sampling_params
        self.lora_request = lora_request
        # A pooling request: runs its prompt once, then finishes with pooled_data.
        self.pooling_params = pooling_params
        self.pooled_data: Any = None
        self.metrics = RequestMetrics(arrival_time or time.time())
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            None if sampling_params.prompt_logprobs is None else [])
        # The stage, set by the scheduler: True from admission (and again after a recompute
        # preemption) until a step that sampled from it has been applied.
        self.in_prefill = True
        self.error: str | None = None  # why it ended with finish_reason "error"
        # Structured outputs: the compiled constraint (structured_outputs.manager.Grammar);
        # the group waits in the scheduler until it is ready.
        self.grammar: Any = None
        # KV transfer: a load from the connector's store failed once; never load again.
        self.kv_load_failed = False

    @property
    def prompt(self) -> str | None:
        return self.seqs[0].prompt

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        return self.seqs if status is None else [s for s in self.seqs if s.status == status]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.get_seqs(status))

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished()]

    def is_finished(self) -> bool:
        return all(s.is_finished() for s in self.seqs)

    def is_prefill(self) -> bool:
        """Still computing its prompt (or recomputing after preemption)."""
        return self.in_prefill

    def max_num_running_seqs(self) -> int:
        """Sequences this group will run at its widest: n before its prompt is sampled."""
        if self.seqs[0].data.output_token_ids or len(self.seqs) > 1:
            return len(self.unfinished_seqs())
        return self.sampling_params.n
