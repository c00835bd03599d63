"""Time the C decode attention kernel (cpu_kernels.paged_decode) on one paged KV cache.

    .venv/bin/python tools/cpu_decode_bench.py

Per dtype (queries and cache both float32, or both bfloat16) and shape (batch, context
length): a cache of block_size 16 with shuffled blocks, 12 query heads over 4 KV heads of 64
(the 125M preset's layer), every sequence at the full context. Prints the best of 5 means of
20 calls: milliseconds per call (one layer of one decode step), GFLOP/s (q . K and P . V) and
the K/V bytes read per second.
"""

from __future__ import annotations

import time

import torch

from fleetllm.attention import cpu_kernels

SHAPES = ((1, 256), (16, 530), (32, 200), (64, 500))
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 4, 64, 16


def time_one(dtype: torch.dtype, batch: int, ctx: int) -> tuple[float, float, float]:
    g = torch.Generator().manual_seed(0)
    per_seq = -(-ctx // BLOCK)
    blocks = batch * per_seq + 8
    cache = torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g)[: batch * per_seq].to(torch.int32)
    starts = torch.arange(0, batch * per_seq, per_seq, dtype=torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    out = torch.empty_like(q)

    def call() -> None:
        cpu_kernels.paged_decode(q, cache, tables, starts, lens, 0, HEAD_DIM ** -0.5, out)

    call()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(20):
            call()
        best = min(best, (time.perf_counter() - t) / 20)
    flops = 4 * batch * HEADS * ctx * HEAD_DIM
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * cache.element_size()
    return best * 1e3, flops / best / 1e9, kv_bytes / best / 1e9


def main() -> None:
    if not cpu_kernels.available():
        raise SystemExit("fleetllm's CPU kernels are not available here")
    print(cpu_kernels.build_info())
    for dtype in (torch.float32, torch.bfloat16):
        for batch, ctx in SHAPES:
            ms, gflops, gbs = time_one(dtype, batch, ctx)
            print(f"{str(dtype).removeprefix('torch.'):9} batch {batch:3} context {ctx:4}: "
                  f"{ms:7.3f} ms  {gflops:5.1f} GFLOP/s  K/V {gbs:5.1f} GB/s")


if __name__ == "__main__":
    main()
