"""Per-step request statistics, derived from the outputs of LLMEngine.step().

The async engine's loop thread feeds every step's outputs to a RequestStatsTracker, which
turns them into one IterationStats per step (tokens, time to first token, inter-token gaps,
finished requests) for the stat loggers (e.g. the server's Prometheus metrics). Timestamps are
wall-clock (time.time()), like the engine's RequestMetrics. A pooling request
(PoolingRequestOutput) counts its prompt tokens and its end-to-end and queue times; it
generates no token, so it has no time to first token and no inter-token latency.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleetllm.engine.outputs import PoolingRequestOutput, RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort" | ...
    # None for aborted requests: their latency says how long the client waited, not the engine.
    e2e_latency: float | None = None
    queue_time: float | None = None


@dataclass
class IterationStats:
    prompt_tokens: int = 0  # of requests whose first token came this step
    generation_tokens: int = 0  # tokens sampled this step, over all sequences
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)  # one per request per step
    finished: list[FinishedRequestStats] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.prompt_tokens or self.generation_tokens or self.finished)


@dataclass
class EngineLoad:
    """The scheduler's queues and the KV pool, as of the last step (a snapshot: readers on
    other threads never touch the scheduler itself)."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_gpu_blocks: int = 0
    num_free_gpu_blocks: int = 0
    worker_restarts: int = 0  # times the engine replaced crashed or hung workers
    # Prompt tokens of requests admitted with a prefix-cache lookup, and of those the tokens
    # found cached (both since the engine started; 0 without prefix caching).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # LoRA adapters (vLLM's lora_requests_info labels): the names of the adapters of running
    # requests, and of waiting ones (swapped ones wait too), sorted and comma-separated.
    running_lora_adapters: str = ""
    waiting_lora_adapters: str = ""
    # Speculative decoding's running totals (SpecDecodeWorkerMetrics; 0 without it).
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_emitted_tokens: int = 0
    taken_at: float = 0.0  # time.time() of the snapshot
    # Times the API process started a new engine core after the core process died
    # (core_client; 0 in the core itself and without one).
    engine_core_restarts: int = 0
    # KV transfer (LLMEngine.kv_transfer_stats: blocks, bytes, requests loaded and saved,
    # load failures; running totals); {} without a KV connector.
    kv_transfer_stats: dict[str, int] = field(default_factory=dict)
    # MoE models: {layer index (a string, as a label and on the wire): max / mean tokens
    # per expert since the start} (engine/expert_load.py, refreshed at most once a second)
    moe_expert_imbalance: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, engine: Any) -> EngineLoad:
        """The snapshot of an LLMEngine, taken on the thread that steps it."""
        sched = engine.scheduler
        blocks = sched.block_manager
        cache = blocks.prefix_cache
        spec = engine.spec_decode_metrics
        return cls(len(sched.running), len(sched.waiting), len(sched.swapped),
                   blocks.num_gpu_blocks, blocks.num_free_gpu_blocks, engine.worker_restarts,
                   cache.queried_tokens if cache else 0, cache.hit_tokens if cache else 0,
                   _adapter_names(sched.running),
                   _adapter_names([*sched.waiting, *sched.swapped]),
                   spec.accepted_tokens if spec else 0, spec.draft_tokens if spec else 0,
                   spec.emitted_tokens if spec else 0, time.time(),
                   kv_transfer_stats=getattr(engine, "kv_transfer_stats", {}),
                   moe_expert_imbalance={str(layer): ratio for layer, ratio in
                                         engine.expert_load_imbalance().items()})

    @property
    def kv_cache_usage(self) -> float:
        if not self.num_gpu_blocks:
            return 0.0
        return 1.0 - self.num_free_gpu_blocks / self.num_gpu_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries \
            if self.prefix_cache_queries else 0.0


def _adapter_names(groups: Iterable[Any]) -> str:
    names = {g.lora_request.lora_name for g in groups if g.lora_request is not None}
    return ",".join(sorted(names))


class StatLogger(Protocol):
    def record(self, stats: IterationStats) -> None: ...


def record_stats(stat_loggers: list[StatLogger], stats: IterationStats) -> None:
    """Hand a step's stats to every logger; one that fails is logged, never raised: metrics
    must never take the engine down."""
    if stats.is_empty():
        return
    for stat_logger in tuple(stat_loggers):
        try:
            stat_logger.record(stats)
        except Exception:
            logger.exception("stat logger %r failed", stat_logger)


@dataclass
class _RequestTimes:
    arrival_time: float
    num_tokens: int = 0
    last_token_time: float | None = None


class RequestStatsTracker:
    """Owned by the engine loop thread: knows each live request's arrival and last token."""

    def __init__(self) -> None:
        self._requests: dict[str, _RequestTimes] = {}

    def add(self, request_id: str, arrival_time: float) -> None:
        self._requests[request_id] = _RequestTimes(arrival_time)

    def observe(self, out: RequestOutput | PoolingRequestOutput, now: float,
                stats: IterationStats) -> None:
        times = self._requests.get(out.request_id)
        if times is None:
            return
        if isinstance(out, PoolingRequestOutput):
            self._observe_pooled(out, times, now, stats)
            return
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        if num_tokens > times.num_tokens:
            stats.generation_tokens += num_tokens - times.num_tokens
            if times.last_token_time is None:
                stats.prompt_tokens += len(out.prompt_token_ids)
                stats.time_to_first_tokens.append(now - times.arrival_time)
            else:
                stats.inter_token_latencies.append(now - times.last_token_time)
            times.num_tokens, times.last_token_time = num_tokens, now
        if out.finished:
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "stop")
            self._finish(out, times, reason, now, stats)

    def _observe_pooled(self, out: PoolingRequestOutput, times: _RequestTimes, now: float,
                        stats: IterationStats) -> None:
        if not out.finished:  # a pooling request has one output, its finished one
            return
        if out.finish_reason == "stop":  # a rejected one ran no prompt
            stats.prompt_tokens += len(out.prompt_token_ids)
        self._finish(out, times, out.finish_reason, now, stats)

    def _finish(self, out: RequestOutput | PoolingRequestOutput, times: _RequestTimes,
                reason: str, now: float, stats: IterationStats) -> None:
        del self._requests[out.request_id]
        scheduled = out.metrics.first_scheduled_time if out.metrics else None
        stats.finished.append(FinishedRequestStats(
            reason, e2e_latency=now - times.arrival_time,
            queue_time=None if scheduled is None else max(0.0, scheduled
                                                          - times.arrival_time)))

    def abort(self, request_id: str, stats: IterationStats) -> None:
        if self._requests.pop(request_id, None) is not None:
            stats.finished.append(FinishedRequestStats("abort"))
