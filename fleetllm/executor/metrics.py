"""Executor performance metrics: what Executor.get_performance_metrics() reports.

Executor.execute_model times every step and feeds MetricsRecorder; the engine reports the
outputs it hands back (requests completed or failed); resource figures are read on each worker
when asked for (worker_usage, sent through collective_rpc, so they come from wherever the
worker runs, for any backend).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from fleetllm.spec_decode.metrics import SpecDecodeWorkerMetrics

WINDOW = 1000  # execute_model calls the latency percentiles and rates cover


@dataclass
class WorkerUsage:
    rank: int
    pid: int | None = None
    rss_bytes: int | None = None  # VmRSS of the worker's process
    # Percent of one core used by the worker's process since the previous metrics call (the
    # first call: since the process started). Under 'uni' the worker is the caller's process.
    cpu_percent: float | None = None
    kv_cache_bytes: int = 0  # the rank's KV pools (device + swap); 0 while asleep
    error: str | None = None  # why this worker could not be measured


@dataclass
class ExecutorMetrics:
    requests_total: int = 0  # requests that reached the workers, or ended without doing so
    requests_completed: int = 0  # finished: stop or length
    requests_failed: int = 0  # finished with finish_reason "error"
    execute_model_calls: int = 0  # successful calls
    execute_model_errors: int = 0  # calls that raised
    latency_window: int = 0  # how many recent calls the latency figures cover
    latency_ms_avg: float | None = None
    latency_ms_p50: float | None = None
    latency_ms_p95: float | None = None
    latency_ms_p99: float | None = None
    requests_per_s: float = 0.0  # requests finished per second over the window
    tokens_per_s: float = 0.0  # tokens sampled per second over the window
    tokens_total: int = 0
    workers: list[WorkerUsage] = field(default_factory=list)
    kv_blocks_total: int | None = None
    kv_blocks_used: int = 0  # blocks held by the sequences of the last step
    world_size: int = 1
    workers_active: int = 0
    workers_failed: int = 0
    restarts: int = 0
    is_sleeping: bool = False
    sleeping_tags: list[str] = field(default_factory=list)
    # Speculative decoding's counts since the start (SpecDecodeWorkerMetrics.to_dict); None:
    # no step has speculated.
    spec_decode: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        rss = [w.rss_bytes for w in self.workers if w.rss_bytes is not None]
        total = self.kv_blocks_total
        return {
            "requests": {"total": self.requests_total, "completed": self.requests_completed,
                         "failed": self.requests_failed},
            "execute_model": {
                "calls": self.execute_model_calls, "errors": self.execute_model_errors,
                "window": self.latency_window,
                "latency_ms": {"avg": self.latency_ms_avg, "p50": self.latency_ms_p50,
                               "p95": self.latency_ms_p95, "p99": self.latency_ms_p99}},
            "throughput": {"requests_per_s": self.requests_per_s,
                           "tokens_per_s": self.tokens_per_s, "tokens_total": self.tokens_total},
            "resources": {
                "rss_bytes_total": sum(rss) if rss else None,
                "workers": [asdict(w) for w in self.workers],
                "kv_cache": {"blocks_total": total, "blocks_used": self.kv_blocks_used,
                             "usage": self.kv_blocks_used / total if total else 0.0,
                             "bytes": sum(w.kv_cache_bytes for w in self.workers)}},
            "workers": {"world_size": self.world_size, "active": self.workers_active,
                        "failed": self.workers_failed, "restarts": self.restarts},
            "sleep": {"is_sleeping": self.is_sleeping, "tags": list(self.sleeping_tags)},
            "spec_decode": self.spec_decode,
        }


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (so p50 <= p95 <= p99 always)."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class MetricsRecorder:
    """Counters and sliding windows, updated by the stepping thread and read by any thread."""

    def __init__(self, window: int = WINDOW) -> None:
        self._lock = threading.Lock()
        self.calls = self.errors = self.restarts = 0
        self.requests_total = self.completed = self.failed = self.tokens_total = 0
        # (start, end, latency, tokens sampled) of the last `window` calls
        self._steps: deque[tuple[float, float, float, int]] = deque(maxlen=window)
        self._finishes: deque[float] = deque(maxlen=window)  # when requests finished
        self._live: set[str] = set()  # requests seen by the workers and not finished yet
        self._last_tables: list[dict[int, list[int]]] = []  # block tables of the last step
        self._cpu_prev: dict[int, tuple[int, float, float]] = {}  # rank: (pid, cpu s, age s)
        self.spec_decode: SpecDecodeWorkerMetrics | None = None  # summed over the steps

    def record_step(self, start: float, latency_s: float, request: Any, output: Any) -> None:
        tokens = 0
        for sampler_output in output or ():
            for group in getattr(sampler_output, "outputs", ()):
                tokens += len(getattr(group, "samples", ()))  # pooling outputs: none
        groups = request.seq_group_metadata_list
        spec = output[0].spec_decode_worker_metrics if output else None
        with self._lock:
            if spec is not None:
                if self.spec_decode is None:
                    self.spec_decode = SpecDecodeWorkerMetrics(spec.num_spec_tokens)
                self.spec_decode.add(spec)
            self.calls += 1
            self.tokens_total += tokens
            self._steps.append((start, start + latency_s, latency_s, tokens))
            for rid in request.finished_requests_ids:
                self._live.discard(rid)
            for g in groups:
                if g.request_id not in self._live:
                    self._live.add(g.request_id)
                    self.requests_total += 1
            # Kept, not counted: the union of block ids is computed only when asked for.
            self._last_tables = [g.block_tables for g in groups]

    def record_error(self) -> None:
        with self._lock:
            self.errors += 1

    def record_restart(self) -> None:
        with self._lock:
            self.restarts += 1

    def record_outputs(self, outputs: Iterable[Any]) -> None:
        """The engine's outputs of one step: finished requests count as completed or failed."""
        now = time.perf_counter()
        with self._lock:
            for out in outputs:
                if not out.finished:
                    continue
                if out.request_id in self._live:
                    self._live.discard(out.request_id)
                else:  # ended without reaching the workers (e.g. could never be scheduled)
                    self.requests_total += 1
                # A pooling output has one vector, no sequences: its own finish_reason.
                reasons = {c.finish_reason for c in out.outputs} if isinstance(
                    out.outputs, list) else {out.finish_reason}
                if "error" in reasons:
                    self.failed += 1
                elif "abort" not in reasons:
                    self.completed += 1
                self._finishes.append(now)

    def snapshot(self, usage: list[WorkerUsage], world_size: int, kv_blocks_total: int | None,
                 is_sleeping: bool, sleeping_tags: Iterable[str]) -> ExecutorMetrics:
        with self._lock:
            steps = list(self._steps)
            finishes = list(self._finishes)
            used = {b for tables in self._last_tables for t in tables.values() for b in t} \
                if self._live else set()
            m = ExecutorMetrics(
                requests_total=self.requests_total, requests_completed=self.completed,
                requests_failed=self.failed, execute_model_calls=self.calls,
                execute_model_errors=self.errors, tokens_total=self.tokens_total,
                restarts=self.restarts, kv_blocks_used=len(used),
                spec_decode=None if self.spec_decode is None else self.spec_decode.to_dict())
        if steps:
            latencies = sorted(s[2] * 1000 for s in steps)
            m.latency_window = len(latencies)
            m.latency_ms_avg = sum(latencies) / len(latencies)
            m.latency_ms_p50, m.latency_ms_p95, m.latency_ms_p99 = (
                percentile(latencies, q) for q in (0.50, 0.95, 0.99))
            begin, end = steps[0][0], steps[-1][1]
            span = max(end, finishes[-1] if finishes else end) - begin
            if span > 0:
                m.tokens_per_s = sum(s[3] for s in steps) / span
                m.requests_per_s = sum(1 for t in finishes if t >= begin) / span
        m.workers = usage
        m.world_size = world_size
        m.workers_active = sum(1 for w in usage if w.error is None)
        m.kv_blocks_total = kv_blocks_total
        m.is_sleeping, m.sleeping_tags = is_sleeping, sorted(sleeping_tags)
        return m

    def cpu_percent(self, rank: int, pid: int, cpu_s: float, age_s: float) -> float | None:
        """Since the previous reading of the same process, or since it started."""
        with self._lock:
            prev = self._cpu_prev.get(rank)
            self._cpu_prev[rank] = (pid, cpu_s, age_s)
        if prev is not None and prev[0] == pid and age_s > prev[2]:
            return 100.0 * (cpu_s - prev[1]) / (age_s - prev[2])
        return 100.0 * cpu_s / age_s if age_s > 0 else None


def performance_metrics(executor: Any) -> dict[str, Any]:
    """Executor.get_performance_metrics(): the recorder's counters and windows, with each
    worker's usage read now (a worker that does not answer is reported with its error)."""
    from fleetllm.errors import EngineShutdownError

    world = executor.parallel_config.world_size
    usage = [WorkerUsage(rank=r) for r in range(world)]
    try:
        results = executor.collective_rpc(worker_usage, timeout=10, return_exceptions=True)
    except EngineShutdownError as e:  # not a failure: nobody is running
        results = [e] * world
        usage = [WorkerUsage(rank=r, error="shut down") for r in range(world)]
    except Exception as e:  # the executor failed: no worker answers
        results = [e] * world
    recorder: MetricsRecorder = executor.metrics
    for rank, result in enumerate(results):
        w = usage[rank]
        if isinstance(result, BaseException):
            first_line = (str(result).splitlines() or [""])[0]
            w.error = w.error or f"{type(result).__name__}: {first_line}"
            continue
        w.pid, w.rss_bytes = result["pid"], result["rss_bytes"]
        w.kv_cache_bytes = result["kv_cache_bytes"]
        if result["age_s"] is not None:
            w.cpu_percent = recorder.cpu_percent(rank, result["pid"], result["cpu_s"],
                                                 result["age_s"])
    m = recorder.snapshot(usage, world, executor.cache_config.num_gpu_blocks,
                          executor.is_sleeping, executor.sleeping_tags)
    m.workers_failed = 0 if executor.is_shut_down else world - m.workers_active
    return m.to_dict()


def worker_usage(worker: Any) -> dict[str, Any]:
    """Runs on a worker (through collective_rpc): its process's RSS, CPU time and age, and the
    size of its KV pools."""
    cache = getattr(worker, "cache_engine", None)
    times = os.times()
    return {"pid": os.getpid(), "rss_bytes": _rss_bytes(), "cpu_s": times.user + times.system,
            "age_s": _process_age_s(),
            "kv_cache_bytes": cache.nbytes() if cache is not None else 0}


def _rss_bytes(pid: int | str = "self") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _process_age_s() -> float | None:
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
