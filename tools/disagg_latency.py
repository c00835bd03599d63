"""Time to first token and end-to-end latency of sequential streamed completions: one
`fleetllm serve` against a kv_producer and a kv_consumer (SharedStorageConnector on one
store) behind `fleetllm proxy` (the figures in docs/kv_transfer.md's "Disaggregated prefill
and decode").

    python tools/disagg_latency.py [--model fleetllm/demo_model] [--input-len 480]
                                   [--output-len 16] [--requests 8] [--rounds 2]

Every request has a new random prompt (no prefix-cache hit anywhere); the first of each
round is a warm-up. The servers run on loopback, each started by LocalServer and stopped at
the end; the store is a temporary directory. Prints the medians per round and the decode
instance's KV transfer counters.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from fleetllm.entrypoints.openai.local_server import LocalServer

REPO = Path(__file__).resolve().parent.parent


def kv_args(store: str, role: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({
        "kv_connector": "SharedStorageConnector", "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": store}})]


def medians(url: str, args: argparse.Namespace, seed: int) -> tuple[float, float]:
    """(median time to first token, median end to end), in ms."""
    rng = random.Random(seed)
    ttfts, e2es = [], []
    for i in range(args.requests + 1):
        prompt = [rng.randrange(10, 4000) for _ in range(args.input_len)]
        body = {"model": "m", "prompt": prompt, "max_tokens": args.output_len,
                "temperature": 0, "ignore_eos": True, "stream": True}
        start = time.perf_counter()
        first = None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter() - start
        if i and first is not None:  # the first is a warm-up
            ttfts.append(first * 1e3)
            e2es.append((time.perf_counter() - start) * 1e3)
    return statistics.median(ttfts), statistics.median(e2es)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "fleetllm" / "demo_model"))
    parser.add_argument("--input-len", type=int, default=480)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    store = tempfile.mkdtemp(prefix="fleetllm-disagg-")
    base = [args.model, "--served-model-name", "m", "--kv-cache-memory", str(64 << 20)]
    servers: list[LocalServer] = []
    try:
        one = LocalServer(base)
        servers.append(one)
        prefill = LocalServer(base + kv_args(store, "kv_producer"))
        servers.append(prefill)
        decode = LocalServer(base + kv_args(store, "kv_consumer"))
        servers.append(decode)
        proxy = LocalServer([], command=[
            sys.executable, "-m", "fleetllm.cli", "proxy", "--port", "0",
            "--prefill", prefill.url, "--decode", decode.url],
            ready_prefix="fleetllm proxy: listening on ")
        servers.append(proxy)
        for rnd in range(args.rounds):
            a = medians(one.url, args, 100 + rnd)
            b = medians(proxy.url, args, 200 + rnd)
            print(f"round {rnd}: one instance TTFT {a[0]:.1f} ms, e2e {a[1]:.1f} ms | "
                  f"prefill+decode via proxy TTFT {b[0]:.1f} ms, e2e {b[1]:.1f} ms",
                  flush=True)
        for line in httpx.get(f"{decode.url}/metrics", timeout=30).text.splitlines():
            if line.startswith("fleetllm:kv_transfer_") and "_total{" in line:
                print("decode instance:", line)
    finally:
        for srv in reversed(servers):
            srv.stop(30)


if __name__ == "__main__":
    main()
