"""fleetllm's own CPU kernels as `torch.ops.fleetllm.*` ops (csrc/), float32 and bfloat16
(float32 math; bf16 rounds where transformers rounds): paged decode and prompt attention read
in place from the KV blocks; the GEMV, the bf16 GEMMs (by pairs, AMX tiles), MKL's packed
sgemm; fused norm, SiLU * up, RoPE + cache write; a decode step's layers and greedy passes in
one call; the sampler's argmax; the fused mixture-of-experts layer (csrc/moe.cpp).
How: `build.load()` compiles this CPU's variant at first use. Every op checks its arguments in
C++ (RuntimeError) and allocates through torch (OutOfMemoryError, not a crash); the ops run on
the kernels' thread pool (csrc/pool.cpp), or torch's with FLEETLLM_KERNEL_THREADS=torch.
What fails: no compiler, a failed build or FLEETLLM_CPU_KERNELS=0 make `available()` False
(one warning) and callers take their PyTorch path; FLEETLLM_CPU_KERNELS=require raises.
"""
from __future__ import annotations

import logging
import threading
from enum import IntEnum
from types import SimpleNamespace

import torch

from fleetllm import envs
from fleetllm.kernels import build

logger = logging.getLogger(__name__)

_ops: SimpleNamespace | None = None
_tried = False
_lock = threading.Lock()
_OPS = ("paged_decode", "prefill_attention", "add_rmsnorm", "silu_mul", "rope_qk_kv", "gemv",
        "decoder_layer", "decoder_layers", "greedy_passes", "argmax", "build_info", "gemm_pairs",
        "gemm_pairs_available", "gemm_amx", "amx_available", "mkl_pack", "mkl_linear",
        "mkl_available", "gguf_linear", "gguf_rows", "fused_moe", "gguf_fused_moe")


def _load() -> SimpleNamespace | None:
    global _ops, _tried
    with _lock:
        if _tried:
            return _ops
        _tried = True
        mode = envs.get("FLEETLLM_CPU_KERNELS")
        if mode == "0":
            return None
        strict = mode == "require" or envs.get("FLEETLLM_KERNEL_SANITIZE")
        try:
            if not hasattr(torch.ops.fleetllm, "gemv"):  # not loaded by this process already
                build.load()
        except build.BuildError as e:
            if strict:
                raise
            logger.warning("fleetllm's CPU kernels are unavailable (%s); using the PyTorch "
                           "path", str(e)[:2000])
            return None
        # The overloads themselves: calling them skips the packet's overload resolution.
        _ops = SimpleNamespace(**{n: getattr(torch.ops.fleetllm, n).default for n in _OPS})
        return _ops


def available() -> bool:
    return (_ops if _tried else _load()) is not None


DTYPES = (torch.float32, torch.bfloat16)


class LinearKind(IntEnum):
    """How the one-call decode paths read a projection (csrc/ops.cpp LinearKind): its dense
    weight through the GEMV, oneDNN's or MKL's packed copy, or a copy packed for the kernels'
    GEMMs (by pairs, AMX tiles), or GGUF: each projection's quantized packed copy
    (fleetllm/quant/packed.py) or, where the file stores it unquantized, its dense weight.
    Each kernel of model/linear_kernels.py names its own."""

    GEMV = 0
    ONEDNN = 1
    MKL = 2
    PAIRS = 3
    AMX = 4
    GGUF = 5


def usable(*tensors: torch.Tensor) -> bool:
    """The kernels apply: CPU float32 or bfloat16 tensors, and the library is loaded. (An op's
    activations and weights share one dtype; a KV cache may have the other.)"""
    for t in tensors:
        if t.dtype not in DTYPES or t.device.type != "cpu":
            return False
    return (_ops if _tried else _load()) is not None


def build_info() -> str:
    """What the loaded library was built as ("isa: avx512f avx2 fma; threads: pool")."""
    if not available():
        raise RuntimeError("fleetllm's CPU kernels are not loaded")
    return _ops.build_info()


# The wrappers below run ~100 times per decode step: plain attribute lookups, no locks. Each
# op checks its own arguments (C++); callers test usable() first.

def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor,
                 table_start: torch.Tensor, ctx_lens: torch.Tensor, window: int | None,
                 scale: float, out: torch.Tensor) -> None:
    """out[b] = attention of q[b] over sequence b's context. q: [B, H, D] (rows may
    be strided, heads and dims contiguous); out: [B, H, D] contiguous; kv_cache: one layer's
    [2, num_blocks, block_size, KVH, D]; tables (every sequence's block ids, concatenated),
    table_start (where each sequence's begin), ctx_lens: int32. window: attend to the last
    `window` positions only."""
    _ops.paged_decode(q, kv_cache, tables, table_start, ctx_lens, window or 0, scale, out)


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, spans: torch.Tensor,
                      slots: torch.Tensor, window: int | None, scale: float,
                      out: torch.Tensor) -> None:
    """out[rows] = causal attention of each prompt span's queries over its context, read from
    the cache. q: [T, H, D] (rows may be strided); out: [T, H, D] contiguous; spans: int32
    [S, 4] rows (q_start, q_len, ctx_len, slot_start): query i of a span sits at row q_start
    + i and sees the context's first ctx_len - q_len + i + 1 tokens (the last `window` of
    them with a window), whose cache slots are slots[slot_start:slot_start + ctx_len] (int64).
    The span's K/V must be in the cache already."""
    _ops.prefill_attention(q, kv_cache, spans, slots, window or 0, scale, out)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> torch.Tensor:
    """rmsnorm(x + residual) * weight, with residual updated to x + residual in place (or
    rmsnorm(x) * weight without one). x, residual: contiguous [T, H]."""
    return _ops.add_rmsnorm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a contiguous [T, 2I] (gate, then up)."""
    return _ops.silu_mul(gate_up)


def rope_qk_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
               kv_heads: int, kv_cache: torch.Tensor | None, slots: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of the q and k parts of the fused qkv output [T, (H + 2 KVH) * D] (rows may be
    strided); with a cache ([2, blocks, block_size, KVH, D], contiguous), k and v are written
    at `slots` (int64). cos, sin: [T, (1,) D/2]. Returns q [T, H, D], k [T, KVH, D]."""
    return _ops.rope_qk_kv(qkv, cos, sin, heads, kv_heads, kv_cache,
                           None if kv_cache is None else slots)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a few rows of x: contiguous x [M, K], weight [N, K] of one
    dtype; float32 sums, rounded once."""
    return _ops.gemv(x, weight, bias)


def gemm_pairs_available() -> bool:
    """Whether this CPU runs gemm_pairs (the kernels' avx512 variant)."""
    return available() and _ops.gemm_pairs_available()


def gemm_pairs(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
    """x @ w.T (+ bias) in bfloat16 from w packed by pairs (linear_kernels.Pairs): contiguous x
    [M, K]; float32 sums over k in order, the bias, one rounding: a row's bits do not depend on
    the rows beside it."""
    return _ops.gemm_pairs(x, packed, bias, out_features)


def mkl_available() -> bool:
    """Whether float32 projections run MKL's packed sgemm here (torch links MKL, an Intel
    CPU: linear_kernels.Mkl)."""
    return available() and _ops.mkl_available()


def mkl_pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] (contiguous) in MKL's packed layout: uint8 bytes."""
    return _ops.mkl_pack(weight)


def mkl_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
    """x @ w.T (+ bias) in float32 from mkl_pack(w): contiguous x [M, K]; the bias rows, then
    the product added (F.linear's order)."""
    return _ops.mkl_linear(x, packed, bias, out_features)


def decoder_layers(x: torch.Tensor, residual: torch.Tensor, first: bool, weights: list,
                   eps: float, heads: int, windows: list[int], scale: float, cos: torch.Tensor,
                   sin: torch.Tensor, kv_caches: list[torch.Tensor], slots: torch.Tensor,
                   tables: torch.Tensor, table_start: torch.Tensor, ctx_lens: torch.Tensor,
                   packed: list, kind: LinearKind = LinearKind.GEMV, *, positions: torch.Tensor,
                   embed: torch.Tensor | None = None, final_norm: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """decoder_layer for each of a step's layers in turn, in one call. weights: 10 a layer
    (decoder_layer's, less eps); windows and kv_caches: one a layer; packed: empty (kind GEMV)
    or 4 a layer, all of `kind`. residual is updated in place (first: set by the first
    layer). With embed ([V, H]), x is the step's token ids (int64 [T]) and the input their
    rows of embed; with final_norm ([H]) the result is add_rmsnorm(output, residual,
    final_norm, eps). cos and sin are the whole RoPE tables; the call takes the rows of the
    step's positions (int64 [T])."""
    return _ops.decoder_layers(x, embed, residual, first, weights, eps, heads, windows, scale,
                               cos, sin, kv_caches, slots, tables, table_start, ctx_lens,
                               packed, int(kind), final_norm, positions)


def greedy_passes(ids: torch.Tensor, weights: list, eps: float, heads: int, windows: list[int],
                  scale: float, cos: torch.Tensor, sin: torch.Tensor,
                  kv_caches: list[torch.Tensor], slots: torch.Tensor, tables: torch.Tensor,
                  table_start: torch.Tensor, ctx_lens: torch.Tensor, packed: list,
                  kind: LinearKind, *, positions: torch.Tensor, embed: torch.Tensor,
                  final_norm: torch.Tensor, head: torch.Tensor, head_kind: LinearKind,
                  head_n: int, stops: torch.Tensor, interrupts: torch.Tensor,
                  interrupts_before: int) -> torch.Tensor:
    """Up to k greedy decode passes: each decoder_layers (embed, layers, final norm) at its
    row of positions, slots and ctx_lens ([k, T]), the LM head (`head` of `head_kind`, head_n
    outputs: what its kernel reads at T rows) and each row's argmax, the next pass's ids. Ends
    early after a pass where interrupts (int64 [1]) is not interrupts_before, or after which
    every row has drawn one of its stops (int64 [T, S], -1 padding; S may be 0).
    Returns the passes' tokens, int64 [passes, T]."""
    return _ops.greedy_passes(ids, embed, weights, eps, heads, windows, scale, cos, sin,
                              kv_caches, slots, tables, table_start, ctx_lens, packed,
                              int(kind), final_norm, positions, head, int(head_kind),
                              head_n, stops, interrupts, interrupts_before)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a [rows, n] x whose rows are contiguous (int64 [rows]):
    the first of equal maxima, the first NaN of a row with one."""
    return _ops.argmax(x)


def decoder_layer(x: torch.Tensor, residual: torch.Tensor, first: bool,
                  weights: tuple, heads: int, window: int, scale: float, cos: torch.Tensor,
                  sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                  tables: torch.Tensor, table_start: torch.Tensor, ctx_lens: torch.Tensor,
                  packed: tuple = (), kind: LinearKind = LinearKind.GEMV) -> torch.Tensor:
    """One decoder layer of a decode batch, no tensor parallelism (model/fused.py).
    weights: (w_in, w_post, eps, w_qkv, b_qkv, w_o, b_o, w_gu, b_gu, w_down, b_down), biases
    None when absent. packed: empty (kind GEMV: the projections run the GEMV kernel on the
    dense weights) or the four projections' packed copies (qkv, o, gate_up, down), all of
    `kind`, computed as their kernels compute them (model/linear_kernels.py). residual is
    updated in place (first: set to x). Returns the layer's output [T, hid]."""
    return _ops.decoder_layer(x, residual, first, *weights, heads, window, scale, cos, sin,
                              kv_cache, slots, tables, table_start, ctx_lens, list(packed),
                              int(kind))


def amx_available() -> bool:
    """Whether this CPU and OS run gemm_amx (AMX-BF16 tiles, FLEETLLM_CPU_AMX not 0)."""
    return available() and _ops.amx_available()


def gemm_amx(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
             out_features: int) -> torch.Tensor:
    """x @ w.T (+ bias) in bfloat16 on AMX tiles from w packed for them
    (linear_kernels.Amx): contiguous x [M, K]; float32 sums over k in order, the bias, one
    rounding."""
    return _ops.gemm_amx(x, packed, bias, out_features)


def gguf_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor:
    """x @ w.T (+ bias) from w's quantized packed copy (fleetllm/quant/packed.py): contiguous
    float32 or bfloat16 x [M, K]; float32 sums, rounded once to x's dtype."""
    return _ops.gguf_linear(x, packed, bias)


def gguf_rows(packed: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows of a quantized packed copy at ids (int64 [T]): an embedding's lookup."""
    return _ops.gguf_rows(packed, ids, dtype)


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor) -> torch.Tensor:
    """The routed experts' weighted sum for x [T, H]: ids int64 [T, k], weights float32
    [T, k], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I] (csrc/moe.cpp)."""
    return _ops.fused_moe(x, ids, weights, w13, w2)


def gguf_fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   packed: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """fused_moe over quantized experts (csrc/moe_quant.cpp): packed holds 2E packed copies
    (expert e's gate/up [2I, H], then its down [H, I]), copy j at bytes bounds[j]..[j + 1]."""
    return _ops.gguf_fused_moe(x, ids, weights, packed, bounds)
