"""Prometheus metrics with vLLM's names (prefix `fleetllm:`), in a registry of their own so
that two apps in one process (tests) never share counters."""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fleetllm.engine.stats import EngineLoad, IterationStats

# vLLM's buckets, with finer ones at the bottom: a small model on a CPU steps in milliseconds.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_REQUEST_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")
# LLMEngine.kv_transfer_stats's keys, each a counter fleetllm:kv_transfer_<key>.
_KV_TRANSFER_COUNTERS = {
    "requests_loaded": "Requests that loaded KV blocks through the KV connector.",
    "blocks_loaded": "KV blocks loaded through the KV connector (loads that failed too).",
    "bytes_loaded": "KV bytes the ranks read through the KV connector (summed over ranks).",
    "requests_saved": "Requests that saved KV blocks through the KV connector.",
    "blocks_saved": "KV blocks saved through the KV connector.",
    "bytes_saved": "KV bytes the ranks wrote through the KV connector (summed over ranks).",
    "load_failures": "Requests whose KV load failed (kv_load_failure_policy applied).",
}


class PrometheusMetrics:
    """A StatLogger (see fleetllm.engine.stats): record() runs on the engine loop thread,
    render() on the server's; prometheus_client's metrics are thread-safe."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 max_loras: int | None = None):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"fleetllm:{name}", doc, label, registry=self.registry
                         ).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"fleetllm:{name}", doc, label, registry=self.registry
                           ).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"fleetllm:{name}", doc, label, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.num_running = gauge("num_requests_running", "Requests running on the engine.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_swapped = gauge("num_requests_swapped", "Requests swapped out to CPU.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generation tokens processed.")
        self._success = Counter("fleetllm:request_success", "Finished requests, by reason.",
                                [*label, "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # present from the start, at 0
            self._success.labels(model_name, reason)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens of a "
                             "request.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.",
                             _REQUEST_BUCKETS)
        self.worker_restarts = counter("worker_restarts", "Times the engine replaced "
                                       "crashed or hung workers (every request resumed).")
        self.core_restarts = counter("engine_core_restarts", "Times a new engine core "
                                     "process was started after it died (every request "
                                     "resumed).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in "
                                      "the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix "
                                   "cache (not computed again).")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "prefix_cache_hits / "
                                     "prefix_cache_queries since the start.")
        # Speculative decoding (vLLM's spec_decode_* names), 0 without it.
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens the "
                                     "target model accepted.")
        self.spec_draft = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_emitted = counter("spec_decode_num_emitted_tokens", "Tokens emitted by "
                                    "sequences that had drafts (accepted + one each).")
        # KV transfer (docs/kv_transfer.md), 0 without a KV connector.
        self.kv_transfer = {key: counter(f"kv_transfer_{key}", doc)
                            for key, doc in _KV_TRANSFER_COUNTERS.items()}
        # The engine's counts are running totals; the Prometheus counters move by the change.
        self._seen = {"restarts": 0, "core_restarts": 0, "queries": 0, "hits": 0,
                      "accepted": 0, "draft": 0, "emitted": 0,
                      **{f"kv_{key}": 0 for key in _KV_TRANSFER_COUNTERS}}
        # MoE models: a gauge a layer, not a counter an expert: Qwen3-30B-A3B's 48 layers x
        # 128 experts would be 6144 series; per-expert counts: LLMEngine.expert_load().
        self.moe_imbalance = Gauge(
            "fleetllm:moe_expert_load_imbalance", "Max / mean tokens routed per expert of an "
            "MoE layer since the start (1: even).", [*label, "layer"], registry=self.registry)
        self._render_lock = threading.Lock()  # two scrapes at once must not count twice
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first "
                                    "scheduled.", _REQUEST_BUCKETS)
        # Only with LoRA enabled (max_loras set), as vLLM's: no model_name label, the
        # adapters in the labels and the time of the engine's snapshot as the value.
        self.max_loras = max_loras
        self.lora_info = None if max_loras is None else Gauge(
            "fleetllm:lora_requests_info", "Running stats on LoRA requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=self.registry)

    def record(self, stats: IterationStats) -> None:
        if stats.prompt_tokens:
            self.prompt_tokens.inc(stats.prompt_tokens)
        if stats.generation_tokens:
            self.generation_tokens.inc(stats.generation_tokens)
        for value in stats.time_to_first_tokens:
            self.ttft.observe(value)
        for value in stats.inter_token_latencies:
            self.itl.observe(value)
        for done in stats.finished:
            self._success.labels(self.model_name, done.finish_reason).inc()
            if done.e2e_latency is not None:
                self.e2e.observe(done.e2e_latency)
            if done.queue_time is not None:
                self.queue_time.observe(done.queue_time)

    def render(self, load: EngineLoad) -> bytes:
        self.num_running.set(load.num_running)
        self.num_waiting.set(load.num_waiting)
        self.num_swapped.set(load.num_swapped)
        self.kv_usage.set(load.kv_cache_usage)
        for layer, ratio in load.moe_expert_imbalance.items():
            self.moe_imbalance.labels(self.model_name, layer).set(ratio)
        with self._render_lock:
            self._move_counters(load)
            self._lora_info(load)
        return generate_latest(self.registry)

    def _lora_info(self, load: EngineLoad) -> None:
        """One series, the current one: vLLM leaves every label set it ever had behind
        (a scraper picks the newest), which grows without bound as adapters come and go."""
        if self.lora_info is None:
            return
        self.lora_info.clear()
        self.lora_info.labels(str(self.max_loras), load.waiting_lora_adapters,
                              load.running_lora_adapters).set(load.taken_at or time.time())

    def _move_counters(self, load: EngineLoad) -> None:
        for key, metric, total in (("restarts", self.worker_restarts, load.worker_restarts),
                                   ("core_restarts", self.core_restarts,
                                    load.engine_core_restarts),
                                   ("queries", self.prefix_queries, load.prefix_cache_queries),
                                   ("hits", self.prefix_hits, load.prefix_cache_hits),
                                   ("accepted", self.spec_accepted,
                                    load.spec_decode_num_accepted_tokens),
                                   ("draft", self.spec_draft, load.spec_decode_num_draft_tokens),
                                   ("emitted", self.spec_emitted,
                                    load.spec_decode_num_emitted_tokens),
                                   *((f"kv_{key}", metric,
                                      load.kv_transfer_stats.get(key, 0))
                                     for key, metric in self.kv_transfer.items())):
            if total > self._seen[key]:
                metric.inc(total - self._seen[key])
                self._seen[key] = total
        self.prefix_hit_rate.set(load.prefix_cache_hit_rate)
