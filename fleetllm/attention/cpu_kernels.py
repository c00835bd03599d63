"""Hand-written C kernels for the CPU, compiled at first use with the system C compiler.

Paged decode attention: one query per sequence over its context, read in place from the KV
blocks (no gathered copy, no padding to the longest context), each K/V byte read once per
step and layer. PyTorch has no such operation: the pure-PyTorch path gathers the context into
a padded tensor first, which measured 5-10x slower on the 125M preset at batch 64.

A small-M matrix-vector product (GEMV) streaming a dense [out, in] weight at the memory's
bandwidth, for decode batches of a few sequences (oneDNN and MKL stream it at half that).

Fused elementwise ops (residual add + RMSNorm, SiLU * up, RoPE of q and k + the K/V cache
write): one pass and at most one parallel region each instead of 2-6 torch kernels, and no
parallel region at all for a few rows, where waking a sleeping OpenMP thread costs more than
the work (OMP_WAIT_POLICY=PASSIVE, which fleetllm sets).

The library is built with `cc -O3 -march=native -fopenmp` into a per-user cache directory
(FLEETLLM_KERNEL_CACHE, default ~/.cache/fleetllm/kernels; keyed by the source, the flags and
the CPU), loaded with ctypes and called with raw pointers. The kernels run on their own small
thread pool (cpu_kernels_src.py: workers spin briefly between calls, then sleep), as many
threads as torch's intra-op count. Without a compiler, or with FLEETLLM_CPU_KERNELS=0,
`available()` is False and every caller runs its pure-PyTorch path; results agree to fp32
rounding.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from fleetllm.attention.cpu_kernels_ops import OPS
from fleetllm.attention.cpu_kernels_src import RUNTIME

_SOURCE = RUNTIME + OPS

logger = logging.getLogger(__name__)


# -fopenmp-simd: only the `omp simd` vectorization hints, no OpenMP runtime.
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
          "-shared", "-fPIC", "-pthread"]
_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()


def _cache_dir() -> Path:
    root = os.environ.get("FLEETLLM_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fleetllm" / \
        "kernels"


def _cpu_id() -> str:
    """-march=native code must not run on another CPU sharing the cache directory."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build(cc: str) -> Path:
    key = hashlib.sha256("\0".join([_SOURCE, cc, *_FLAGS, _cpu_id()]).encode()).hexdigest()
    out_dir = _cache_dir()
    target = out_dir / f"fleetllm_kernels_{key[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / "kernels.c"
        src.write_text(_SOURCE)
        built = Path(tmp) / "kernels.so"
        subprocess.run([cc, *_FLAGS, str(src), "-o", str(built)], check=True,
                       capture_output=True, timeout=120)
        os.replace(built, target)  # atomic: concurrent builders each install a whole file
    return target


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("FLEETLLM_CPU_KERNELS", "1") == "0":
            return None
        try:
            lib = ctypes.CDLL(str(_build(os.environ.get("CC", "cc"))))
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            logger.warning("CPU attention kernels unavailable (%s%s); using the PyTorch path",
                           e, ": " + detail.decode(errors="replace")[:500] if detail else "")
            return None
        p, i, f, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
        signatures = {
            "paged_decode_f32": [p, n, p, p, p, p, p, p, i, i, i, i, i, i, f, i],
            "add_rmsnorm_f32": [p, p, p, p, i, i, f, i],
            "silu_mul_f32": [p, p, i, i, i],
            "rope_qk_kv_f32": [p, n, p, p, p, p, p, p, p, i, i, i, i, i],
            "gemv_f32": [p, p, p, p, i, i, i, i],
            "decoder_layer_f32": [p, p, i, p, p, p, f, p, p, p, p, p, p, p, p, p, p, p, p, p,
                                  p, p, p, i, i, i, i, i, i, i, i, f, i],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        _lib = lib
        return lib


def available() -> bool:
    return (_lib if _tried else _load()) is not None


def usable(*tensors: torch.Tensor) -> bool:
    """The kernels apply: CPU float32 tensors, and the library is built."""
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            return False
    return (_lib if _tried else _load()) is not None


# The wrappers below run ~100 times per decode step: plain attribute lookups, no locks.

def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor,
                 table_start: torch.Tensor, ctx_lens: torch.Tensor, window: int | None,
                 scale: float, out: torch.Tensor) -> None:
    """out[b] = attention of q[b] over sequence b's context. q: [B, H, D] float32 (rows may
    be strided, heads and dims contiguous); out: [B, H, D] contiguous; kv_cache: one layer's
    [2, num_blocks, block_size, KVH, D]; tables, table_start, ctx_lens: int32 (see the C
    source)."""
    b, h, d = q.shape
    _, _, block_size, kvh, _ = kv_cache.shape
    if not (available() and q.dtype == out.dtype == torch.float32 and q.stride(2) == 1
            and q.stride(1) == d and out.is_contiguous() and kv_cache.is_contiguous()
            and tables.dtype == table_start.dtype == ctx_lens.dtype == torch.int32):
        raise ValueError("paged_decode: unsupported inputs")
    _lib.paged_decode_f32(q.data_ptr(), q.stride(0), kv_cache[0].data_ptr(),
                          kv_cache[1].data_ptr(), tables.data_ptr(), table_start.data_ptr(),
                          ctx_lens.data_ptr(), out.data_ptr(), b, h, kvh, d, block_size,
                          window or 0, scale, torch.get_num_threads())


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> torch.Tensor:
    """rmsnorm(x + residual) * weight, with residual updated to x + residual in place (or
    rmsnorm(x) * weight without one). x, residual: contiguous [T, H]."""
    out = torch.empty_like(x)
    _lib.add_rmsnorm_f32(x.data_ptr(), None if residual is None else residual.data_ptr(),
                         weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
                         torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a contiguous [T, 2I] (gate, then up)."""
    t, two_i = gate_up.shape
    out = torch.empty((t, two_i // 2), dtype=gate_up.dtype)
    _lib.silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2,
                      torch.get_num_threads())
    return out


def rope_qk_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
               kv_heads: int, kv_cache: torch.Tensor | None, slots: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of the q and k parts of the fused qkv output [T, (H + 2 KVH) * D] (rows may be
    strided); with a cache ([2, blocks, block_size, KVH, D], contiguous), k and v are written
    at `slots` (int64). Returns q [T, H, D], k [T, KVH, D], contiguous."""
    t = qkv.shape[0]
    d = qkv.shape[1] // (heads + 2 * kv_heads)
    q = torch.empty((t, heads, d), dtype=qkv.dtype)
    k = torch.empty((t, kv_heads, d), dtype=qkv.dtype)
    caches = (None, None, None) if kv_cache is None else \
        (kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), slots.data_ptr())
    _lib.rope_qk_kv_f32(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
                        q.data_ptr(), k.data_ptr(), *caches, t, heads, kv_heads, d,
                        torch.get_num_threads())
    return q, k


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a few rows of x: contiguous float32 x [M, K], weight [N, K]."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype)
    _lib.gemv_f32(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                  out.data_ptr(), m, n, k, torch.get_num_threads())
    return out


def decoder_layer(x: torch.Tensor, residual: torch.Tensor, first: bool,
                  weights: tuple[int, ...], dims: tuple[int, ...], cos: torch.Tensor,
                  sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                  tables: torch.Tensor, table_start: torch.Tensor, ctx_lens: torch.Tensor
                  ) -> torch.Tensor:
    """One decoder layer of a small decode batch (see decoder_layer_f32). weights: the
    layer's (w_in, w_post, eps, w_qkv, b_qkv, w_o, b_o, w_gu, b_gu, w_down, b_down) as
    pointers (0: no bias) and eps; dims: (hid, H, KVH, D, I, block_size, window, scale).
    residual is updated in place. Returns the layer's output [T, hid]."""
    t = x.shape[0]
    out = torch.empty_like(x)
    _lib.decoder_layer_f32(x.data_ptr(), residual.data_ptr(), int(first), out.data_ptr(),
                           *weights, cos.data_ptr(), sin.data_ptr(), kv_cache[0].data_ptr(),
                           kv_cache[1].data_ptr(), slots.data_ptr(), tables.data_ptr(),
                           table_start.data_ptr(), ctx_lens.data_ptr(), t, *dims,
                           torch.get_num_threads())
    return out
