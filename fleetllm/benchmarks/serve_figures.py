"""The figures of `fleetllm bench serve`: each request's result as the client timed it, the
run's summary (vLLM's client's figures: throughput, TTFT, TPOT, ITL and E2E mean / median /
p99) and how both are printed; the fleetllm / vLLM ratios of `--compare vllm`."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    structured: bool = False  # a grammar request (--structured-fraction)


def _stats(values: list[float], name: str) -> dict[str, float]:
    if not values:
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"p99_{name}_ms": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {f"mean_{name}_ms": statistics.fmean(ordered) * 1000,
            f"median_{name}_ms": statistics.median(ordered) * 1000, f"p99_{name}_ms": p99 * 1000}


def _tpots(results: list[RequestResult]) -> list[float]:
    # vLLM's TPOT: a request's time after its first token over its other tokens.
    return [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]


def summarize(results: list[RequestResult], duration: float, args: argparse.Namespace
              ) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    by_class = {}
    if getattr(args, "structured_fraction", 0.0) > 0:
        for name, grammar in (("plain", False), ("structured", True)):
            done = [r for r in ok if r.structured is grammar]
            by_class[f"{name}_completed"] = len(done)
            by_class[f"{name}_output_tokens"] = sum(r.output_tokens for r in done)
            by_class.update({f"{name}_{k}": v for k, v in _stats(_tpots(done),
                                                                  "tpot").items()})
    return {
        "base_url": args.base_url, "num_prompts": len(results), "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "max_concurrency": args.max_concurrency, "duration_s": duration,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        **_stats([r.ttft for r in ok], "ttft"),
        **_stats(_tpots(ok), "tpot"),
        **_stats([x for r in ok for x in r.itls], "itl"),
        **_stats([r.e2e for r in ok], "e2e"),
        "structured_fraction": getattr(args, "structured_fraction", 0.0),
        **by_class,
    }


def print_result(result: dict[str, Any], title: str = "Serving Benchmark Result") -> None:
    print(f"{f' {title} ':=^60}")
    rows = [("Successful requests", result["completed"]), ("Failed requests", result["failed"]),
            ("Request rate (req/s)", result["request_rate"]),
            ("Benchmark duration (s)", f"{result['duration_s']:.2f}"),
            ("Total generated tokens", result["total_output_tokens"]),
            ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}")]
    for name, label in (("ttft", "Time to First Token"),
                        ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"),
                        ("e2e", "End-to-end Latency")):
        rows.append((f"--- {label}", ""))
        rows += [(f"{kind.capitalize()} {name.upper()} (ms)", f"{result[f'{kind}_{name}_ms']:.2f}")
                 for kind in ("mean", "median", "p99")]
    if "structured_completed" in result:
        rows.append(("--- TPOT by class (--structured-fraction)", ""))
        for name, label in (("plain", "Plain"), ("structured", "Grammar")):
            rows.append((f"{label} requests", result[f"{name}_completed"]))
            rows += [(f"{label} {kind} TPOT (ms)", f"{result[f'{name}_{kind}_tpot_ms']:.2f}")
                     for kind in ("mean", "median", "p99")]
    for label, value in rows:
        print(f"{label:<40}{value:>20}" if value != "" else f"{label:-<60}")
    for error in result["errors"]:
        print(f"error: {error}")
    print("=" * 60)


RATIOS = (("request_throughput", "request throughput (higher: better)"),
          ("output_throughput", "output tokens/s (higher: better)"),
          ("mean_ttft_ms", "mean TTFT (lower: better)"),
          ("mean_tpot_ms", "mean TPOT (lower: better)"),
          ("mean_itl_ms", "mean ITL (lower: better)"))


def ratios(fleet: dict[str, Any], peer: dict[str, Any]) -> dict[str, float]:
    """fleetllm / vLLM: above 1 is better for throughput, below 1 for latencies."""
    return {key: fleet[key] / peer[key] if peer[key] else float("nan") for key, _ in RATIOS}


def print_ratios(values: dict[str, float], title: str = "fleetllm / vllm serve (same requests)"
                 ) -> None:
    print(f"{f' {title} ':=^60}")
    for key, label in RATIOS:
        print(f"{label:<40}{values[key]:>19.2f}x")
    print("=" * 60)
