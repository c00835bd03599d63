"""Time the C prompt attention kernel (cpu_kernels.prefill_attention) against the PyTorch path
it replaced (SDPA, spans of similar length padded into one call), one layer of one step.

    .venv/bin/python tools/cpu_prefill_bench.py

Per dtype (queries and cache both float32, or both bfloat16) and step: one prompt of 64 to
700 tokens, or 16 prompts of 18-255 tokens (the 125M preset's prompts); 12 query heads over 4
KV heads of 64 (the preset's layer), a cache of block_size 16 with shuffled slots. Prints the
best of 5 means of 10 calls: milliseconds per call and GFLOP/s (causal q . K and P . V).
"""

from __future__ import annotations

import time

import torch

from fleetllm.attention import AttentionMetadata, PrefillSpan, backend
from fleetllm.kernels import cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 4, 64, 16
STEPS = {"1 x 64": [64], "1 x 256": [256], "1 x 700": [700],
         "16 x 18-255": torch.randint(18, 256, (16,), generator=torch.Generator().manual_seed(0)
                                      ).tolist()}


def best_ms(call) -> float:
    call()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            call()
        best = min(best, (time.perf_counter() - t) / 10)
    return best * 1e3


def time_step(dtype: torch.dtype, lengths: list[int]) -> tuple[float, float, float]:
    g = torch.Generator().manual_seed(1)
    n = sum(lengths)
    slots = torch.randperm(n + 8 * BLOCK, generator=g)[:n]
    cache = torch.zeros(2, -(-n // BLOCK) + 8, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g).to(dtype)
    k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    k_cache, v_cache = (cache[i].view(-1, KV_HEADS, HEAD_DIM) for i in (0, 1))
    k_cache[slots], v_cache[slots] = k, v
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    pairs = list(zip(starts, lengths, strict=True))
    meta = AttentionMetadata(slots, [PrefillSpan(s, m, m, None) for s, m in pairs])
    spans = torch.tensor([(s, m, m, s) for s, m in pairs], dtype=torch.int32)
    out = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5
    kernel = best_ms(lambda: cpu_kernels.prefill_attention(q, cache, spans, slots, None, scale,
                                                           out))
    sdpa = best_ms(lambda: backend._prefill(q, k, v, k_cache, v_cache, meta, scale, None, out))
    flops = sum(4 * HEADS * HEAD_DIM * m * (m + 1) / 2 for m in lengths)
    return kernel, sdpa, flops / 1e9


def main() -> None:
    if not cpu_kernels.available():
        raise SystemExit("fleetllm's CPU kernels are not available here")
    print(cpu_kernels.build_info())
    for dtype in (torch.float32, torch.bfloat16):
        for name, lengths in STEPS.items():
            kernel, sdpa, gflop = time_step(dtype, lengths)
            print(f"{str(dtype).removeprefix('torch.'):9} {name:12}: kernel {kernel:7.3f} ms "
                  f"({gflop / kernel * 1e3:5.1f} GFLOP/s)  PyTorch {sdpa:7.3f} ms "
                  f"({gflop / sdpa * 1e3:5.1f} GFLOP/s)  {sdpa / kernel:4.2f}x")


if __name__ == "__main__":
    main()
