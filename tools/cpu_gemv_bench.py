"""Time the C GEMV kernel (cpu_kernels.gemv: decode steps' projections) in two settings.

    .venv/bin/python tools/cpu_gemv_bench.py
    .venv/bin/python tools/cpu_gemv_bench.py --setting model --rows 8 12 16 24 --onednn
    .venv/bin/python tools/cpu_gemv_bench.py --setting model qwen2-0.5b --dtype bfloat16 \
        --rows 1 4 8 16 32 64 --onednn --pairs

Settings: "cache" (one 4096 x 768 weight called over and over: the kernel's arithmetic),
"model" (the 125M preset's projections and LM head from memory, as a decode step reads them),
"demo" (the demo model's), "qwen2-0.5b" and "llama-1b" (part of those models' layers).
Prints per dtype and row count the best of 7 passes as weight bytes read per second;
`--onednn` adds oneDNN's packed copy (where linear_kernels.gemv_limits comes from), `--pairs`
the bf16 GEMM on weights packed by pairs, `--huge-pages` places the weights as the loader does.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch
from torch import nn

from fleetllm.kernels import cpu_kernels
from fleetllm.model import huge_pages
from fleetllm.model.linear_kernels import OneDnn, Pairs

ROWS = (1, 2, 4, 8)
LAYER = [(1280, 768), (768, 768), (4096, 768), (768, 2048)]  # qkv, o, gate/up, down
DEMO_LAYER = [(512, 256), (256, 256), (1376, 256), (256, 688)]  # fleetllm/demo_model's
QWEN_LAYER = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # Qwen2-0.5B's
LLAMA_1B_LAYER = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # Llama-3.2-1B's
SHAPES = {"cache": [(4096, 768)], "model": LAYER * 12 + [(32000, 768)],
          "demo": DEMO_LAYER * 4 + [(4096, 256)],
          # a third of Qwen2-0.5B's layers and a quarter of Llama-3.2-1B's, and their LM heads
          "qwen2-0.5b": QWEN_LAYER * 8 + [(151936, 896)],
          "llama-1b": LLAMA_1B_LAYER * 4 + [(128256, 2048)]}
CALLS = {"cache": 100, "model": 1, "demo": 10, "qwen2-0.5b": 1, "llama-1b": 1}


def weights(setting: str, dtype: torch.dtype, huge: bool = False) -> list[torch.Tensor]:
    """The setting's weights; huge: in one huge-page mapping, as the loader places a model's
    parameters (model/huge_pages.py), instead of torch's own allocations."""
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(n, k, generator=g) * 0.05).to(dtype) for n, k in SHAPES[setting]]
    if huge:
        holder = nn.Module()
        holder.ws = nn.ParameterList(nn.Parameter(w.clone(), requires_grad=False) for w in ws)
        if not huge_pages.place_parameters(holder):
            raise SystemExit("--huge-pages: no huge pages here (THP off or refused)")
        with torch.no_grad():
            for p, w in zip(holder.ws, ws, strict=True):
                p.copy_(w)
        ws = [p.data for p in holder.ws]
    return ws


def pack_pairs(ws: list[torch.Tensor], huge: bool) -> list:
    """ws packed by pairs; huge: in one huge-page arena, as kernel_choice.select_kernels packs
    a model's."""
    if not huge:
        return [Pairs.pack(w) for w in ws]
    arena = huge_pages.empty(sum(map(Pairs.size, ws)))
    out, offset = [], 0
    for w in ws:
        size = Pairs.size(w)
        out.append(Pairs.pack(w, arena[offset:offset + size]))
        offset += size
    return out


def seconds(ws: list, dtype: torch.dtype, rows: int, calls: int, fn) -> float:
    """Best of 7 passes of fn(x, w) over every weight, `calls` times each."""
    g = torch.Generator().manual_seed(1)
    xs = {k: torch.randn(rows, k, generator=g).to(dtype) for k in {w.shape[1] for w in ws}}
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            for w in ws:
                fn(xs[w.shape[1]], w)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], nargs="+",
                        default=["bfloat16", "float32"])
    parser.add_argument("--setting", choices=list(SHAPES), nargs="+",
                        default=["cache", "model"])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--huge-pages", action="store_true",
                        help="place the weights in huge pages, as a loaded model's are")
    parser.add_argument("--onednn", action="store_true",
                        help="also time oneDNN's packed copy (ms per pass)")
    parser.add_argument("--pairs", action="store_true",
                        help="also time the bf16 GEMM on weights packed by pairs (ms per pass; "
                             "CPUs with AVX-512 BF16: linear_kernels.Pairs)")
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("fleetllm's CPU kernels are not available here")
    print(f"kernels: {cpu_kernels.build_info()}; torch threads: {torch.get_num_threads()}")
    for setting in args.setting:
        for name in args.dtype:
            dtype = getattr(torch, name)
            ws = weights(setting, dtype, args.huge_pages)
            calls = CALLS[setting]
            nbytes = calls * sum(w.numel() * w.element_size() for w in ws)
            kernel = {m: seconds(ws, dtype, m, calls, lambda x, w: cpu_kernels.gemv(x, w, None))
                      for m in args.rows}
            figures = "  ".join(f"{m} rows {nbytes / t / 1e9:5.1f}" for m, t in kernel.items())
            print(f"{setting:5s} {name:8s} GB/s: {figures}")
            others = {"oneDNN": args.onednn, "pairs GEMM": args.pairs and dtype == torch.bfloat16
                      and Pairs.applies(ws[0])}
            for label, wanted in others.items():
                if not wanted:
                    continue
                if label == "oneDNN":
                    copies = [OneDnn(w) for w in ws]
                else:  # in one huge-page arena with --huge-pages, as the loader packs them
                    copies = pack_pairs(ws, args.huge_pages)
                packed = [SimpleNamespace(kernel=p, shape=w.shape)
                          for p, w in zip(copies, ws, strict=True)]
                other = {m: seconds(packed, dtype, m, calls, lambda x, p: p.kernel(x))
                         for m in args.rows}
                del packed
                figures = "  ".join(f"{m} rows {kernel[m] * 1e3:.1f} vs {other[m] * 1e3:.1f}"
                                    for m in args.rows)
                print(f"{setting:5s} {name:8s} ms, kernel vs {label}: {figures}")


if __name__ == "__main__":
    main()
