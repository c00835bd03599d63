"""Round-trip latency of the executor's RPC path: a no-op collective_rpc and an empty
execute_model (ExecuteModelRequest([])), for a backend next to `uni` (and `mp`, when the backend
is another one, such as `ray`) measured in the same run.

    fleetllm bench rpc --backend mp --tensor-parallel-size 2 [--model PATH] [--iters N]
    fleetllm bench rpc --backend ray    (ray, mp and uni; a local Ray instance, or $RAY_ADDRESS)
    python -m fleetllm.benchmarks.rpc ...   (the same)

Without --model a tiny Llama config is written to a temp dir and loaded with dummy weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from fleetllm.engine.arg_utils import HelpFormatter

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}


def _noop(worker) -> None:
    return None


def measure(fn: Callable[[], object], iters: int, warmup: int = 50) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def summarize(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median_us": statistics.median(ordered) * 1e6,
            "p99_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6}


def bench_backend(model: str, backend: str, tp: int, pp: int, iters: int) -> dict[str, dict]:
    from fleetllm.config import EngineConfig
    from fleetllm.executor import Executor
    from fleetllm.sequence import ExecuteModelRequest

    # Without weights (the default tiny config) the workers use random ones.
    load_format = "auto" if any(Path(model).glob("*.safetensors")) else "dummy"
    cfg = EngineConfig.from_kwargs(model=model, tensor_parallel_size=tp,
                                   pipeline_parallel_size=pp,
                                   distributed_executor_backend=backend,
                                   load_format=load_format, kv_cache_memory=16 << 20)
    with Executor.get_class(cfg)(cfg) as ex:
        ex.initialize_cache(*ex.determine_num_available_blocks())
        return {
            "noop_method": summarize(measure(lambda: ex.collective_rpc("check_health"), iters)),
            "noop_callable": summarize(measure(lambda: ex.collective_rpc(_noop), iters)),
            "empty_execute_model": summarize(measure(
                lambda: ex.execute_model(ExecuteModelRequest([])), iters)),
        }


def _peers(backend: str) -> list[str]:
    """The backends measured beside uni: the one asked for, and mp as the local yardstick."""
    return [backend] if backend in ("uni", "mp") else [backend, "mp"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="mp", help="executor backend to compare with uni "
                        "(another than mp, e.g. ray: with mp as well)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=2,
                        help="workers per pipeline stage")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="pipeline stages")
    parser.add_argument("--model", default=None, help="checkpoint dir (default: tiny, dummy)")
    parser.add_argument("--iters", type=int, default=2000, help="timed calls per measurement")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m fleetllm.benchmarks.rpc",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> dict:
    """Measure, print, and return the figures."""
    with tempfile.TemporaryDirectory(prefix="fleetllm-bench-") as tmp:
        model = args.model
        if model is None:
            model = tmp
            (Path(tmp) / "config.json").write_text(json.dumps(TINY_CONFIG))
        results = {"uni": bench_backend(model, "uni", 1, 1, args.iters)}
        for backend in _peers(args.backend):
            results[backend] = bench_backend(model, backend, args.tensor_parallel_size,
                                             args.pipeline_parallel_size, args.iters)
    if args.json:
        print(json.dumps(results))
        return results
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    peers = _peers(args.backend)
    print(f"{args.iters} iterations; {' and '.join(peers)} with "
          f"tp={args.tensor_parallel_size} pp={args.pipeline_parallel_size} ({world} workers) "
          "vs uni (in-process)")
    print(f"{'call':<22}{'backend':<8}{'median us':>12}{'p99 us':>12}{'median vs uni':>16}")
    for call in results["uni"]:
        base = results["uni"][call]["median_us"]
        for backend in ("uni", *peers):
            r = results[backend][call]
            ratio = f"{r['median_us'] / base:.1f}x" if base > 0 else "-"
            print(f"{call:<22}{backend:<8}{r['median_us']:>12.1f}{r['p99_us']:>12.1f}"
                  f"{ratio:>16}")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
