"""Time the C GEMV kernel (cpu_kernels.gemv: decode steps' projections) in two settings.

    .venv/bin/python tools/cpu_gemv_bench.py

"cache": one 4096 x 768 weight (the 125M preset's gate/up projection: 6 MB in bfloat16, 12
in float32) called over and over, so it stays in the last-level cache and the kernel's own
arithmetic is what is timed. "model": the preset's 48 layer projections and its LM head
(100M parameters), one call each per pass, read from memory as a decode step reads them.
Per dtype and number of rows of x (the decode batch): the best of 7 passes, as weight bytes
read per second.
"""

from __future__ import annotations

import argparse
import time

import torch

from fleetllm.attention import cpu_kernels

ROWS = (1, 2, 4, 8)
LAYER = [(1280, 768), (768, 768), (4096, 768), (768, 2048)]  # qkv, o, gate/up, down


def weights(setting: str, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(4096, 768)] if setting == "cache" else LAYER * 12 + [(32000, 768)]
    return [(torch.randn(n, k, generator=g) * 0.05).to(dtype) for n, k in shapes]


def gb_per_s(ws: list[torch.Tensor], rows: int, calls: int) -> float:
    g = torch.Generator().manual_seed(1)
    xs = {k: torch.randn(rows, k, generator=g).to(ws[0].dtype) for k in {w.shape[1] for w in ws}}
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            for w in ws:
                cpu_kernels.gemv(xs[w.shape[1]], w, None)
        best = min(best, time.perf_counter() - start)
    return calls * sum(w.numel() * w.element_size() for w in ws) / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], nargs="+",
                        default=["bfloat16", "float32"])
    parser.add_argument("--setting", choices=["cache", "model"], nargs="+",
                        default=["cache", "model"])
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("fleetllm's CPU kernels are not available here")
    print(f"kernels: {cpu_kernels.build_info()}; torch threads: {torch.get_num_threads()}")
    for setting in args.setting:
        for name in args.dtype:
            ws = weights(setting, getattr(torch, name))
            calls = 100 if setting == "cache" else 1
            figures = "  ".join(f"{m} rows {gb_per_s(ws, m, calls):5.1f}" for m in ROWS)
            print(f"{setting:5s} {name:8s} GB/s: {figures}")


if __name__ == "__main__":
    main()
