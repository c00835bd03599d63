"""Time the C decode attention kernel (cpu_kernels.paged_decode) on paged KV caches.

    .venv/bin/python tools/cpu_decode_bench.py [--cold] [--heads 12 --kv-heads 4]

Per dtype (queries and cache both float32, or both bfloat16) and shape (batch, context
length): a cache of block_size 16 with shuffled blocks, 12 query heads over 4 KV heads of 64
(the 125M preset's layer; --heads / --kv-heads / --head-dim for others, e.g. 14 / 2 for
Qwen2-0.5B), every sequence at the full context. Prints the best of 5 means of 20 calls:
milliseconds per call (one layer of one decode step), GFLOP/s (q . K and P . V) and the K/V
bytes read per second.

By default one cache is called again and again, so it stays in the caches up to L3 (as a
short context's does). --cold gives each of 12 layers a cache of its own, in huge pages as the
engine's, and calls them in turn, as a decode step does: a large batch's K/V then comes from
memory (the 125M preset's throughput workload reads ~13 MB a layer at 64 x 200).
"""

from __future__ import annotations

import argparse
import time

import torch

from fleetllm.kernels import cpu_kernels
from fleetllm.model import huge_pages

SHAPES = ((1, 256), (16, 530), (32, 200), (64, 500))
BLOCK, LAYERS = 16, 12


def time_one(dtype: torch.dtype, batch: int, ctx: int, heads: int = 12, kv_heads: int = 4,
             head_dim: int = 64, cold: bool = False) -> tuple[float, float, float]:
    if not cpu_kernels.available():
        raise SystemExit("fleetllm's CPU kernels are not available here")
    g = torch.Generator().manual_seed(0)
    per_seq = -(-ctx // BLOCK)
    blocks = batch * per_seq + 8
    shape = (2, blocks, BLOCK, kv_heads, head_dim)
    caches = []
    for _ in range(LAYERS if cold else 1):
        cache = huge_pages.zeros(shape, dtype) if cold else torch.empty(shape, dtype=dtype)
        caches.append(cache.copy_(torch.randn(shape, generator=g)))
    tables = torch.randperm(blocks, generator=g)[: batch * per_seq].to(torch.int32)
    starts = torch.arange(0, batch * per_seq, per_seq, dtype=torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    out = torch.empty_like(q)

    def call() -> None:
        for cache in caches:
            cpu_kernels.paged_decode(q, cache, tables, starts, lens, 0, head_dim ** -0.5, out)

    call()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(20):
            call()
        best = min(best, (time.perf_counter() - t) / 20 / len(caches))
    flops = 4 * batch * heads * ctx * head_dim
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * caches[0].element_size()
    return best * 1e3, flops / best / 1e9, kv_bytes / best / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold", action="store_true",
                        help="12 layers' caches in turn, from memory (as a decode step)")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), nargs="+",
                        default=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    print(cpu_kernels.build_info() if cpu_kernels.available() else "no CPU kernels")
    for name in args.dtype:
        for batch, ctx in SHAPES:
            ms, gflops, gbs = time_one(getattr(torch, name), batch, ctx, args.heads,
                                       args.kv_heads, args.head_dim, args.cold)
            print(f"{name:9} batch {batch:3} context {ctx:4}: "
                  f"{ms:7.3f} ms  {gflops:5.1f} GFLOP/s  K/V {gbs:5.1f} GB/s")


if __name__ == "__main__":
    main()
