"""A quantized model's memory after load (docs/quantization.md, Memory): the process's resident
set grown by LLM(path) on one in-process worker, beside the file's size and the KV cache's.

    .venv/bin/python tools/quant_memory.py MODEL [--blocks 64]

MODEL: a .gguf file or an AWQ / GPTQ / compressed-tensors directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--blocks", type=int, default=64, help="KV cache blocks (of 16 tokens)")
    args = parser.parse_args()
    from fleetllm import LLM  # imported before the baseline: torch and fleetllm's own RSS

    path = Path(args.model)
    size = path.stat().st_size if path.is_file() else sum(
        f.stat().st_size for f in path.glob("*.safetensors"))
    base = rss_mib()
    with LLM(str(path), max_model_len=2048, num_gpu_blocks_override=args.blocks,
             swap_space=0) as llm:
        grown = rss_mib() - base
        cache = llm.llm_engine.model_executor.driver_worker.worker.cache_engine
        kv = sum(t.numel() * t.element_size() for t in cache.gpu_cache) / 2**20
    model = size / 2**20
    print(f"{path.name}: resident set +{grown:.0f} MiB after load; weights file {model:.0f} "
          f"MiB, KV cache {kv:.0f} MiB: {grown / (model + kv):.2f}x (the tokenizer included)")


if __name__ == "__main__":
    main()
