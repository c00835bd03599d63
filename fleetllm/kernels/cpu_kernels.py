"""fleetllm's own CPU kernels, as `torch.ops.fleetllm.*` ops (C++ sources in `csrc/`), in
float32 and bfloat16 (float32 math; in bfloat16 they round where transformers' modules round,
csrc/kernels.h).

Paged decode attention: one query per sequence over its context, read in place from the KV
blocks (no gathered copy, no padding to the longest context), each K/V byte read once per
step and layer. PyTorch has no such operation: the pure-PyTorch path gathers the context into
a padded tensor first, which measured 5-10x slower on the 125M preset at batch 64.

A small-M matrix-vector product (GEMV) streaming a dense [out, in] weight at the memory's
bandwidth, for decode batches of a few sequences (oneDNN and MKL stream it at half that). On
CPUs with AVX-512, a bf16 GEMM on weights packed by pairs (gemm_pairs, csrc/gemm.cpp;
model/pair_packed.py) for every number of rows instead: faster than the GEMV and oneDNN alike
(by AVX-512 BF16's vdpbf16ps, or by FMAs where the CPU lacks it or runs it slowly).

Fused elementwise ops (residual add + RMSNorm, SiLU * up, RoPE of q and k + the K/V cache
write): one pass and at most one parallel region each instead of 2-6 torch kernels, and no
parallel region at all for a few rows, where waking a sleeping OpenMP thread costs more than
the work. And one whole decoder layer of a decode step as one call (model/fused.py): its
projections through the GEMV for a few sequences, through oneDNN's packed matmul, called from
C++, for more (or, packed by pairs, the bf16 GEMM for any number).

Each row's argmax for the sampler, read in place in float32 or bfloat16 (torch's CPU argmax
runs ~1 ns an element, ten times its max).

How: `build.load()` compiles the variant for this CPU's instruction set at first use
(torch.utils.cpp_extension; see that module for why JIT and how the build is shared) and loads
it. Each op has a schema (torch.ops.fleetllm.gemv.default._schema) and checks dtype, device,
layout, shapes and index ranges in C++: a bad call raises RuntimeError, it cannot read or write
outside its tensors. Outputs and scratch are torch tensors, so an allocation failure raises
torch.OutOfMemoryError (errors.as_out_of_memory: OutOfMemoryError), not a crash. The kernels
run on their own small thread pool (csrc/pool.cpp: workers spin briefly between calls, then
sleep; fork-safe), or on torch's threads with FLEETLLM_KERNEL_THREADS=torch; as many threads
as torch's intra-op count.

What fails: without a compiler or ninja, if the build fails, or with FLEETLLM_CPU_KERNELS=0,
`available()` is False (one warning says why) and every caller runs its pure-PyTorch path;
results agree to fp32 rounding. FLEETLLM_CPU_KERNELS=require (and the sanitizer run) raises
instead of falling back.
"""

from __future__ import annotations

import logging
import threading
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
        "mkl_available")


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
    """x @ w.T (+ bias) in bfloat16 from w packed by pairs (layers.PairPacked): contiguous x
    [M, K]; float32 sums over k in order, the bias, one rounding: a row's bits do not depend on
    the rows beside it."""
    return _ops.gemm_pairs(x, packed, bias, out_features)


def mkl_available() -> bool:
    """Whether float32 projections run MKL's packed sgemm here (torch links MKL, an Intel
    CPU: model/mkl_packed.py)."""
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
                   packed: list, *, positions: torch.Tensor, embed: torch.Tensor | None = None,
                   final_norm: torch.Tensor | None = None) -> torch.Tensor:
    """decoder_layer for each of a step's layers in turn, in one call. weights: 10 a layer
    (decoder_layer's, less eps); windows and kv_caches: one a layer; packed: empty or 4 a
    layer. residual is updated in place (first: set by the first layer). With embed ([V, H]),
    x is the step's token ids (int64 [T]) and the input their rows of embed; with final_norm
    ([H]) the result is add_rmsnorm(output, residual, final_norm, eps). cos and sin are the
    whole RoPE tables; the call takes the rows of the step's positions (int64 [T])."""
    return _ops.decoder_layers(x, embed, residual, first, weights, eps, heads, windows, scale,
                               cos, sin, kv_caches, slots, tables, table_start, ctx_lens,
                               packed, final_norm, positions)


def greedy_passes(ids: torch.Tensor, weights: list, eps: float, heads: int, windows: list[int],
                  scale: float, cos: torch.Tensor, sin: torch.Tensor,
                  kv_caches: list[torch.Tensor], slots: torch.Tensor, tables: torch.Tensor,
                  table_start: torch.Tensor, ctx_lens: torch.Tensor, packed: list, *,
                  positions: torch.Tensor, embed: torch.Tensor, final_norm: torch.Tensor,
                  head: torch.Tensor, head_n: int, gemv_rows: int, stops: torch.Tensor,
                  interrupts: torch.Tensor, interrupts_before: int) -> torch.Tensor:
    """Up to k greedy decode passes: each decoder_layers (embed, layers, final norm) at its
    row of positions, slots and ctx_lens ([k, T]), the LM head (`head`, head_n outputs: what
    layers.linear reads at T rows; the GEMV kernel up to gemv_rows rows of a dense one) and
    each row's argmax, the next pass's ids. Ends early after a pass where interrupts (int64
    [1]) is not interrupts_before, or after which every row has drawn one of its stops (int64
    [T, S], -1 padding; S may be 0).
    Returns the passes' tokens, int64 [passes, T]."""
    return _ops.greedy_passes(ids, embed, weights, eps, heads, windows, scale, cos, sin,
                              kv_caches, slots, tables, table_start, ctx_lens, packed,
                              final_norm, positions, head, head_n, gemv_rows, stops,
                              interrupts, interrupts_before)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a [rows, n] x whose rows are contiguous (int64 [rows]):
    the first of equal maxima, the first NaN of a row with one."""
    return _ops.argmax(x)


def decoder_layer(x: torch.Tensor, residual: torch.Tensor, first: bool,
                  weights: tuple, heads: int, window: int, scale: float, cos: torch.Tensor,
                  sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                  tables: torch.Tensor, table_start: torch.Tensor, ctx_lens: torch.Tensor,
                  packed: tuple = ()) -> torch.Tensor:
    """One decoder layer of a decode batch, no tensor parallelism (model/fused.py).
    weights: (w_in, w_post, eps, w_qkv, b_qkv, w_o, b_o, w_gu, b_gu, w_down, b_down), biases
    None when absent. packed: empty (the projections run the GEMV kernel) or the four
    projections' packed weights (qkv, o, gate_up, down), all oneDNN's (they run oneDNN's
    matmul as layers.linear does) or all PairPacked.data (the bf16 GEMM). residual is updated
    in place (first: set to x). Returns the layer's output [T, hid]."""
    return _ops.decoder_layer(x, residual, first, *weights, heads, window, scale, cos, sin,
                              kv_cache, slots, tables, table_start, ctx_lens, list(packed))


def amx_available() -> bool:
    """Whether this CPU and OS run gemm_amx (AMX-BF16 tiles, FLEETLLM_CPU_AMX not 0)."""
    return available() and _ops.amx_available()


def gemm_amx(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
             out_features: int) -> torch.Tensor:
    """x @ w.T (+ bias) in bfloat16 on AMX tiles from w packed for them
    (model/amx_packed.py): contiguous x [M, K]; float32 sums over k in order, the bias, one
    rounding."""
    return _ops.gemm_amx(x, packed, bias, out_features)
