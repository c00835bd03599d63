"""Every torch.ops.fleetllm op on fixed inputs, so that kernels loaded in different processes
(another instruction-set variant, the other thread mode) can be compared output for output.

`python tests/kernel_cases.py OUT` saves {op: outputs, "build_info": ...} to OUT with
torch.save, from whatever variant this process loads (FLEETLLM_CPU_ISA, ...)."""

from __future__ import annotations

import sys

import torch

from fleetllm.kernels import cpu_kernels


def decode_inputs(g: torch.Generator, batch: int, heads: int, kv_heads: int, d: int, bs: int):
    """A paged cache and the block tables of `batch` sequences of 1-150 tokens."""
    blocks = 64
    cache = torch.randn(2, blocks, bs, kv_heads, d, generator=g)
    lens = torch.randint(1, 150, (batch,), generator=g, dtype=torch.int32)
    tables, starts = [], []
    for n in lens.tolist():
        starts.append(len(tables))
        tables += torch.randint(0, blocks, (-(-n // bs),), generator=g).tolist()
    i32 = torch.int32
    return cache, torch.tensor(tables, dtype=i32), torch.tensor(starts, dtype=i32), lens


def op_outputs(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, object] = {}
    for m, n, k in ((1, 700, 300), (3, 64, 17), (4, 2048, 768)):
        x, w, b = (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g),
                   torch.randn(n, generator=g))
        out[f"gemv{m}x{n}x{k}"] = cpu_kernels.gemv(x, w, b)
    for t, h in ((1, 768), (70, 100)):
        x, r, w = (torch.randn(t, h, generator=g) for _ in range(3))
        out[f"add_rmsnorm{t}x{h}"] = (cpu_kernels.add_rmsnorm(x, r, w[0], 1e-6), r)
        out[f"rmsnorm{t}x{h}"] = cpu_kernels.add_rmsnorm(x, None, w[0], 1e-5)
        out[f"silu_mul{t}x{h}"] = cpu_kernels.silu_mul(torch.randn(t, 2 * h, generator=g) * 4)
    for batch, heads, kvh, d, bs, window in ((1, 12, 4, 64, 16, 0), (9, 8, 2, 128, 1, 7),
                                             (5, 4, 4, 16, 4, 0)):
        cache, tables, starts, lens = decode_inputs(g, batch, heads, kvh, d, bs)
        q = torch.randn(batch, heads, d, generator=g)
        o = torch.empty_like(q)
        cpu_kernels.paged_decode(q, cache, tables, starts, lens, window, d ** -0.5, o)
        out[f"paged_decode{batch}x{heads}x{d}"] = o
    for heads, kvh, d, window in ((12, 4, 64, 0), (8, 8, 128, 9)):
        cache = torch.randn(2, 40, 16, kvh, d, generator=g)
        slots = torch.randperm(640, generator=g)
        # a fresh prompt of 37 tokens, then 21 new tokens after a cached prefix of 50
        spans = torch.tensor([[0, 37, 37, 0], [37, 21, 71, 37]], dtype=torch.int32)
        q = torch.randn(58, heads, d, generator=g)
        o = torch.empty_like(q)
        cpu_kernels.prefill_attention(q, cache, spans, slots, window, d ** -0.5, o)
        out[f"prefill_attention{heads}x{kvh}x{d}"] = o
    t, h, kvh, d, bs = 3, 4, 2, 16, 16
    cache, tables, starts, lens = decode_inputs(g, t, h, kvh, d, bs)
    qkv = torch.randn(t, (h + 2 * kvh) * d + 5, generator=g)[:, :-5]  # strided rows
    cos, sin = torch.randn(t, 1, d // 2, generator=g), torch.randn(t, 1, d // 2, generator=g)
    slots = torch.randperm(cache.shape[1] * bs, generator=g)[:t]
    c = cache.clone()
    out["rope_qk_kv"] = (*cpu_kernels.rope_qk_kv(qkv, cos, sin, h, kvh, c, slots), c)
    y, residual, cache = decoder_layer_call(g, cos, sin)
    out["decoder_layer"] = (y, residual, cache)
    x = torch.randint(-4, 5, (70, 1000), generator=g).float()  # ties in every row
    x[3, 500] = float("nan")
    out["argmax"] = (cpu_kernels.argmax(x), cpu_kernels.argmax(x.bfloat16()))
    return out


def decoder_layer_args(g: torch.Generator, cos: torch.Tensor, sin: torch.Tensor) -> dict:
    """cpu_kernels.decoder_layer's arguments for a decode batch of 3 (4 heads, 2 KV heads of
    16, hidden 32, intermediate 48; biases on qkv and down)."""
    t, h, kvh, d, bs, hid, inter = 3, 4, 2, 16, 16, 32, 48
    cache, tables, starts, lens = decode_inputs(g, t, h, kvh, d, bs)
    slots = torch.randperm(cache.shape[1] * bs, generator=g)[:t]
    weights = (torch.randn(hid, generator=g), torch.randn(hid, generator=g), 1e-6,
               torch.randn((h + 2 * kvh) * d, hid, generator=g) * 0.2,
               torch.randn((h + 2 * kvh) * d, generator=g), torch.randn(hid, h * d, generator=g)
               * 0.2, None, torch.randn(2 * inter, hid, generator=g) * 0.2, None,
               torch.randn(hid, inter, generator=g) * 0.2, torch.randn(hid, generator=g))
    return dict(x=torch.randn(t, hid, generator=g), residual=torch.empty(t, hid), first=True,
                weights=weights, heads=h, window=0, scale=d ** -0.5, cos=cos, sin=sin,
                kv_cache=cache, slots=slots, tables=tables, table_start=starts, ctx_lens=lens)


def decoder_layer_call(g: torch.Generator, cos: torch.Tensor, sin: torch.Tensor):
    args = decoder_layer_args(g, cos, sin)
    return cpu_kernels.decoder_layer(**args), args["residual"], args["kv_cache"]


def flat(value: object) -> list[torch.Tensor]:
    return list(value) if isinstance(value, tuple) else [value]


if __name__ == "__main__":
    assert cpu_kernels.available(), "the kernels did not load"
    torch.set_num_threads(2)
    results = op_outputs()
    results["build_info"] = cpu_kernels.build_info()
    torch.save(results, sys.argv[1])
