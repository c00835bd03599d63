"""Compare the pure-PyTorch decode attention variants of fleetllm/attention/backend.py
(FLEETLLM_CUDA_DECODE: sdpa, math32, varlen) on one paged KV cache.

    PYTHONPATH=$PWD python3 tools/cuda_decode_bench.py          # CUDA, ~1 min on an H200
    PYTHONPATH=$PWD python3 tools/cuda_decode_bench.py --cpu    # small shapes, CPU fallback

Per dtype (bfloat16, float32) and shape (batch b, longest context L; the contexts are drawn in
[0.75 L, L] as a mixed batch has them, so the groups carry a padding mask): a cache of
block_size 16 with shuffled blocks, DecodeBatch metadata as the model runner builds it, q as a
strided view into a fused qkv row. Each variant's output against a float64 dense reference
(max abs error), the median of 20 timed calls with the step's plan already built (what each of
a step's layers pays), and the plan build itself (once per step). Prints a table and writes it
as JSON to $OUT/cuda_decode.json (./cuda_decode.json without $OUT). A failing variant prints
its exception and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import traceback

import torch

from fleetllm.attention import (
    AttentionMetadata,
    DecodeBatch,
    TorchAttentionBackend,
    backend,
)
from fleetllm.kernels import cpu_kernels

VARIANTS = ["sdpa", "math32", "varlen"]


def build(b: int, max_len: int, heads: int, kv_heads: int, d: int, bs: int,
          dtype: torch.dtype, device: str, seed: int = 0):
    rng = random.Random(seed)
    lens = [max_len] + [rng.randint(max(1, (3 * max_len) // 4), max_len) for _ in range(b - 1)]
    blocks_per = [-(-n // bs) for n in lens]
    num_blocks = sum(blocks_per) + 8
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = torch.randn(2, num_blocks, bs, kv_heads, d, generator=gen, device=device).to(dtype)
    tables, starts = [], []
    for n in blocks_per:
        starts.append(len(tables))
        tables += [free.pop() for _ in range(n)]
    i32 = torch.int32
    dec = DecodeBatch(torch.tensor(tables, dtype=i32, device=device),
                      torch.tensor(starts, dtype=i32, device=device),
                      torch.tensor(lens, dtype=i32, device=device))
    # q as the model passes it: the first H heads of a fused [b, H + 2 KVH, d] qkv row.
    qkv = torch.randn(b, heads + 2 * kv_heads, d, generator=gen, device=device).to(dtype)
    q = qkv[:, :heads]
    slots = []
    for i, n in enumerate(lens):
        t = torch.tensor(tables[starts[i]: starts[i] + blocks_per[i]], device=device)
        pos = torch.arange(n, device=device)
        slots.append(t[pos // bs] * bs + pos % bs)
    return q, cache, dec, lens, slots


def reference(q, cache, lens, slots, scale, window):
    """float64 dense attention per sequence (query head h reads KV head h // g)."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads = cache.shape[3]
    flat = cache.view(2, -1, kv_heads, d).double()
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for i, n in enumerate(lens):
        s = slots[i][max(0, n - window):] if window else slots[i]
        k = flat[0, s].repeat_interleave(heads // kv_heads, 1)  # [t, H, d]
        v = flat[1, s].repeat_interleave(heads // kv_heads, 1)
        p = torch.einsum("hd,thd->ht", q[i].double(), k).mul(scale).softmax(-1)
        out[i] = torch.einsum("ht,thd->hd", p, v)
    return out


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_variant(variant, q, cache, dec, scale, window, reps, device):
    backend._DECODE_VARIANT = variant
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long, device=device), [], dec)

    def call():
        return TorchAttentionBackend.forward(q, None, None, cache, meta, scale, window,
                                             kv_written=True)

    sync(device)
    t0 = time.perf_counter()
    out = call()  # builds the step's plan
    sync(device)
    first = time.perf_counter() - t0
    for _ in range(2):
        call()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        call()
        sync(device)
        times.append(time.perf_counter() - t0)
        if times[-1] > 0.5 and len(times) >= 3:  # a pathological variant: enough samples
            break
    med = statistics.median(times)
    return out, med, max(0.0, first - med)


def top_kernels(variant, q, cache, dec, scale, window, device):
    """The CUDA kernels one call launches, by time (which SDPA backend ran)."""
    from torch.profiler import ProfilerActivity, profile
    backend._DECODE_VARIANT = variant
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long, device=device), [], dec)
    TorchAttentionBackend.forward(q, None, None, cache, meta, scale, window, kv_written=True)
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        TorchAttentionBackend.forward(q, None, None, cache, meta, scale, window,
                                      kv_written=True)
        sync(device)
    rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total",
                                                              getattr(e, "cuda_time_total", 0)))
    return [(e.key[:90], round(getattr(e, "device_time_total",
                                       getattr(e, "cuda_time_total", 0)), 1))
            for e in rows[:4]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="CPU, small shapes (the fallback path)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=80.0, help="skip the rest after this")
    args = ap.parse_args()
    start = time.perf_counter()
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --cpu)")
        return 2
    # Decode must take the PyTorch path everywhere (on CPU the C kernel would otherwise run).
    cpu_kernels.usable = lambda *a: False
    heads, kv_heads, d, bs = (32, 8, 64, 16) if not args.cpu else (8, 2, 64, 16)
    batches, lengths = ([1, 16, 64], [128, 1024, 4096]) if not args.cpu else ([1, 4], [64, 256])
    # (b, L, window): the grid, plus one sliding-window shape (window not a block multiple).
    shapes = [(b, n, None) for b in batches for n in lengths]
    shapes.append((batches[1], lengths[1], lengths[1] // 4 + 3))
    variants = [v for v in args.variants.split(",") if v]
    scale = d ** -0.5
    info = {"torch": torch.__version__, "device": device,
            "name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
            "heads": heads, "kv_heads": kv_heads, "head_dim": d, "block_size": bs}
    print(json.dumps(info))
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        auto = None
        for b, n, window in shapes:
            if time.perf_counter() - start > args.budget_s:
                print(f"time budget spent: skipping {dtype} b={b} L={n}")
                continue
            q, cache, dec, lens, slots = build(b, n, heads, kv_heads, d, bs, dtype, device)
            if auto is None:
                backend._DECODE_VARIANT = "auto"
                auto = backend._decode_variant(q)
                print(f"auto resolves to {auto!r} for {dtype} on {device}")
            ref = reference(q, cache, lens, slots, scale, window)
            for variant in variants:
                row = {"dtype": str(dtype).split(".")[-1], "b": b, "L": n, "window": window,
                       "variant": variant, "auto": variant == auto}
                if variant == "varlen" and device == "cuda" and dtype not in backend._HALF:
                    row["error"] = "n/a: FlashAttention takes float16/bfloat16 only"
                    rows.append(row)
                    continue
                try:
                    out, med, plan = run_variant(variant, q, cache, dec, scale, window,
                                                 args.reps, device)
                    row.update(ms=round(med * 1e3, 4), plan_ms=round(plan * 1e3, 3),
                               max_abs_err=float((out.double() - ref).abs().max()))
                except Exception as e:  # noqa: BLE001 - report it, go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    traceback.print_exc(limit=3)
                rows.append(row)
                if device == "cuda":
                    torch.cuda.empty_cache()
            del q, cache, dec, ref
    kernels = {}
    if device == "cuda" and time.perf_counter() - start < args.budget_s + 5:
        q, cache, dec, _, _ = build(16, 1024, heads, kv_heads, d, bs, torch.bfloat16, device)
        for variant in variants:
            try:
                kernels[variant] = top_kernels(variant, q, cache, dec, scale, None, device)
            except Exception as e:  # noqa: BLE001
                kernels[variant] = f"{type(e).__name__}: {str(e)[:200]}"
    backend._DECODE_VARIANT = "auto"

    print(f"\n{'dtype':9}{'b':>4}{'L':>6}{'win':>5}  {'variant':8}{'ms':>10}{'plan ms':>9}"
          f"{'max err':>11}")
    for r in rows:
        head = (f"{r['dtype']:9}{r['b']:>4}{r['L']:>6}{str(r['window'] or '-'):>5}  "
                f"{r['variant'] + ('*' if r['auto'] else ''):8}")
        if "error" in r:
            print(head + "  " + r["error"][:100])
        else:
            print(head + f"{r['ms']:>10.3f}{r['plan_ms']:>9.2f}{r['max_abs_err']:>11.2e}")
    print("(* = what FLEETLLM_CUDA_DECODE=auto picks; ms = one layer's call, plan built)")
    for variant, ks in kernels.items():
        print(f"kernels {variant} (bf16 b=16 L=1024): {ks}")
    out_dir = os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "cuda_decode.json")
    with open(path, "w") as f:
        json.dump({"info": info, "rows": rows, "kernels": kernels,
                   "seconds": round(time.perf_counter() - start, 1)}, f, indent=1)
    print(f"wrote {path} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
