"""Hand-written C kernels for the CPU, compiled at first use with the system C compiler.

Paged decode attention: one query per sequence over its context, read in place from the KV
blocks (no gathered copy, no padding to the longest context), each K/V byte read once per
step and layer. PyTorch has no such operation: the pure-PyTorch path gathers the context into
a padded tensor first, which measured 5-10x slower on the 125M preset at batch 64.

The library is built with `cc -O3 -march=native -fopenmp` into a per-user cache directory
(FLEETLLM_KERNEL_CACHE, default ~/.cache/fleetllm/kernels; keyed by the source, the flags and
the CPU), loaded with ctypes and called with raw pointers. Its OpenMP runtime is torch's own
(the same libgomp.so.1 soname: the loader reuses the copy torch loaded), and every call passes
torch's thread count. Without a compiler, or with FLEETLLM_CPU_KERNELS=0, `available()` is
False and the backend runs its pure-PyTorch path; results agree to fp32 rounding.
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

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One sequence's work item: query heads [kh0*G, (kh0+nkv)*G) of seq b. D is a literal in the
   specialized callers below, so the inner loops vectorize with known trip counts. */
static inline __attribute__((always_inline)) void decode_item(
    const float *q, const float *k, const float *v, const int32_t *table,
    int start, int len, int kh0, int nkv, float *out, int H, int KVH, const int D, int bs,
    float scale, float *scores, float *acc)
{
    const int G = H / KVH, nh = nkv * G;
    const long tok = (long)KVH * D;          /* floats per token slot in a block */
    const int b0 = start / bs, b1 = (len + bs - 1) / bs;
    const int n = (b1 - b0) * bs;            /* whole blocks; the ends are masked */
    const int lo = start - b0 * bs, hi = len - b0 * bs;
    const float *qb = q + (long)kh0 * G * D;
    for (int blk = b0; blk < b1; blk++) {    /* scores = q . K, block by block */
        const float *kb = k + (long)table[blk] * bs * tok + (long)kh0 * D;
        const int base = (blk - b0) * bs;
        for (int o = 0; o < bs; o++) {
            for (int kh = 0; kh < nkv; kh++) {
                const float *kp = kb + o * tok + (long)kh * D;
                for (int g = 0; g < G; g++) {
                    const int h = kh * G + g;
                    const float *qh = qb + (long)h * D;
                    float s = 0.f;
                    #pragma omp simd reduction(+:s)
                    for (int d = 0; d < D; d++) s += qh[d] * kp[d];
                    scores[(long)h * n + base + o] = s * scale;
                }
            }
        }
    }
    for (int h = 0; h < nh; h++) {            /* softmax over the visible positions */
        float *sh = scores + (long)h * n;
        float m = -INFINITY, sum = 0.f;
        for (int t = lo; t < hi; t++) m = sh[t] > m ? sh[t] : m;
        for (int t = 0; t < lo; t++) sh[t] = 0.f;
        for (int t = hi; t < n; t++) sh[t] = 0.f;
        #pragma omp simd reduction(+:sum)
        for (int t = lo; t < hi; t++) { const float e = expf(sh[t] - m); sh[t] = e; sum += e; }
        const float inv = 1.f / sum;
        #pragma omp simd
        for (int t = lo; t < hi; t++) sh[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * (size_t)nh * D);
    for (int blk = b0; blk < b1; blk++) {    /* out = P . V */
        const float *vb = v + (long)table[blk] * bs * tok + (long)kh0 * D;
        const int base = (blk - b0) * bs;
        const int o0 = base < lo ? lo - base : 0;
        const int o1 = base + bs <= hi ? bs : hi - base;
        for (int o = o0; o < o1; o++) {
            for (int kh = 0; kh < nkv; kh++) {
                const float *vp = vb + o * tok + (long)kh * D;
                for (int g = 0; g < G; g++) {
                    const int h = kh * G + g;
                    const float w = scores[(long)h * n + base + o];
                    float *ah = acc + (long)h * D;
                    #pragma omp simd
                    for (int d = 0; d < D; d++) ah[d] += w * vp[d];
                }
            }
        }
    }
    memcpy(out + (long)kh0 * G * D, acc, sizeof(float) * (size_t)nh * D);
}

/* q: B rows of H*D floats, q_stride floats apart; out: [B, H, D] contiguous; k, v: one
   layer's [num_blocks, bs, KVH, D] caches; seq b's blocks are tables[table_start[b]...],
   it attends to positions [max(0, len - window), len) (window <= 0: all). */
void paged_decode_f32(const float *q, long q_stride, const float *k, const float *v,
                      const int32_t *tables, const int32_t *table_start,
                      const int32_t *ctx_lens, float *out, int B, int H, int KVH, int D,
                      int bs, int window, float scale, int nthreads)
{
    int maxlen = 0;
    for (int b = 0; b < B; b++) maxlen = ctx_lens[b] > maxlen ? ctx_lens[b] : maxlen;
    /* Whole sequences per item read whole token rows (better prefetching); a small batch
       splits by KV head so that every thread has work. */
    const int split = B >= 4 * nthreads ? 1 : KVH;
    const int nkv = KVH / split;
    #pragma omp parallel num_threads(nthreads)
    {
        float *scores = malloc(sizeof(float) * (size_t)H * (maxlen + 2 * bs));
        float *acc = malloc(sizeof(float) * (size_t)H * D);
        #pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < B * split; item++) {
            const int b = item / split, kh0 = (item % split) * nkv, len = ctx_lens[b];
            const int start = window > 0 && len > window ? len - window : 0;
            const float *qb = q + (long)b * q_stride;
            float *ob = out + (long)b * H * D;
            const int32_t *table = tables + table_start[b];
            if (D == 64)
                decode_item(qb, k, v, table, start, len, kh0, nkv, ob, H, KVH, 64,
                            bs, scale, scores, acc);
            else if (D == 128)
                decode_item(qb, k, v, table, start, len, kh0, nkv, ob, H, KVH, 128,
                            bs, scale, scores, acc);
            else
                decode_item(qb, k, v, table, start, len, kh0, nkv, ob, H, KVH, D,
                            bs, scale, scores, acc);
        }
        free(scores);
        free(acc);
    }
}
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
          "-shared", "-fPIC"]
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
        fn = lib.paged_decode_f32
        fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_float, ctypes.c_int]
        fn.restype = None
        _lib = lib
        return lib


def available() -> bool:
    return _load() is not None


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor,
                 table_start: torch.Tensor, ctx_lens: torch.Tensor, window: int | None,
                 scale: float, out: torch.Tensor) -> None:
    """out[b] = attention of q[b] over sequence b's context. q: [B, H, D] float32 (rows may
    be strided, heads and dims contiguous); out: [B, H, D] contiguous; kv_cache: one layer's
    [2, num_blocks, block_size, KVH, D]; tables, table_start, ctx_lens: int32 (see the C
    source)."""
    lib = _load()
    b, h, d = q.shape
    _, _, block_size, kvh, _ = kv_cache.shape
    if not (lib is not None and q.dtype == out.dtype == torch.float32 and q.stride(2) == 1
            and q.stride(1) == d and out.is_contiguous() and kv_cache.is_contiguous()
            and tables.dtype == table_start.dtype == ctx_lens.dtype == torch.int32):
        raise ValueError("paged_decode: unsupported inputs")
    lib.paged_decode_f32(q.data_ptr(), q.stride(0), kv_cache[0].data_ptr(),
                         kv_cache[1].data_ptr(), tables.data_ptr(), table_start.data_ptr(),
                         ctx_lens.data_ptr(), out.data_ptr(), b, h, kvh, d, block_size,
                         window or 0, scale, torch.get_num_threads())
