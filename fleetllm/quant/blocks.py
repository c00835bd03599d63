"""The GGML block types fleetllm reads, quantized and dequantized in numpy.

What: SUPPORTED is the set of ggml tensor types fleetllm's GGUF loader and kernels accept.
quantize() turns float rows into a type's raw blocks (uint8, llama.cpp's byte layout);
dequantize() turns raw blocks back into float32 through gguf.quants, the reference every kernel
is checked against.
How: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 go through gguf.quants.quantize (bit-exact
with ggml's reference quantizers). gguf has no quantizer for the K types, so Q4_K, Q5_K and Q6_K
are written here, vectorized over blocks: per sub-block a min/max (Q4_K, Q5_K) or signed abs-max
(Q6_K) scale, one least-squares refit of scale (and min) for the rounded levels, then the
scales quantized against the super-block's fp16 d (and dmin) and the levels rounded again with
the scales as stored. The packing is ggml-common.h's block_q4_K / block_q5_K / block_q6_K, the
inverse of gguf.quants' Q4_K / Q5_K / Q6_K dequantize_blocks. Rows are done in chunks of about
a million weights, so memory stays a few times the chunk whatever the tensor's size.
Failures: a type outside SUPPORTED, a row length K not a multiple of the type's block, or raw
bytes that do not match a shape raise ConfigurationError naming the type and the sizes. NaN or
inf in the input of a block type raises ConfigurationError (its blocks would be garbage).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from fleetllm.errors import ConfigurationError

T = GGMLQuantizationType

SUPPORTED: frozenset[GGMLQuantizationType] = frozenset({
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K,
})
FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})
QK_K = 256
_CHUNK_WEIGHTS = 1 << 20  # weights per quantization step
_SEARCH = (-0.5, 0.0, 0.5)  # level-count offsets the K quantizers try per sub-block


def as_qtype(qtype: GGMLQuantizationType | str | int) -> GGMLQuantizationType:
    """`qtype` as a supported GGMLQuantizationType ("Q4_K", 12 and T.Q4_K are all accepted)."""
    try:
        t = T[qtype.upper()] if isinstance(qtype, str) else T(qtype)
    except (KeyError, ValueError):
        t = None
    if t is None or t not in SUPPORTED:
        names = ", ".join(sorted(s.name for s in SUPPORTED))
        raise ConfigurationError(f"ggml type {qtype!r} is not supported by fleetllm; "
                                 f"supported: {names}")
    return t


def block_shape(qtype: GGMLQuantizationType | str) -> tuple[int, int]:
    """(weights per block, bytes per block) of a supported type."""
    return GGML_QUANT_SIZES[as_qtype(qtype)]


def row_bytes(qtype: GGMLQuantizationType | str, k: int) -> int:
    """Bytes of one row of k weights; ConfigurationError when k is not a multiple of the block."""
    t = as_qtype(qtype)
    block, nbytes = GGML_QUANT_SIZES[t]
    if k <= 0 or k % block:
        raise ConfigurationError(f"a {t.name} row holds whole blocks of {block} weights; "
                                 f"a row of {k} is not a multiple of {block}")
    return k // block * nbytes


def quantize(array: np.ndarray, qtype: GGMLQuantizationType | str) -> np.ndarray:
    """Rows [..., K] of floats -> uint8 [..., K // block * block_bytes] in `qtype`'s layout."""
    t = as_qtype(qtype)
    x = np.asarray(array)
    if x.ndim == 0:
        raise ConfigurationError("quantize needs an array of at least one dimension")
    nbytes = row_bytes(t, x.shape[-1])
    x = x.astype(np.float32, copy=False)
    if t not in FLOAT_TYPES and not np.isfinite(x).all():
        raise ConfigurationError(f"cannot quantize to {t.name}: the tensor holds NaN or inf")
    rows = x.reshape(-1, x.shape[-1])
    if t == T.F32:
        out = np.ascontiguousarray(rows).view(np.uint8)
    elif t == T.F16:
        out = rows.astype(np.float16).view(np.uint8)
    elif t in _K_QUANTIZERS:
        out = np.empty((rows.shape[0], nbytes), np.uint8)
        step = max(1, _CHUNK_WEIGHTS // rows.shape[1])
        for start in range(0, rows.shape[0], step):
            part = rows[start:start + step]
            packed = _K_QUANTIZERS[t](part.reshape(-1, QK_K))
            out[start:start + step] = packed.reshape(part.shape[0], nbytes)
    else:
        out = np.asarray(gq.quantize(rows, t)).view(np.uint8)
    return out.reshape(*x.shape[:-1], nbytes)


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType | str,
               shape: tuple[int, ...]) -> np.ndarray:
    """Raw blocks of `qtype` -> float32 array of `shape` (gguf.quants' reference decoding; for
    F32 a view of `raw`, not a copy)."""
    t = as_qtype(qtype)
    shape = tuple(int(s) for s in shape)
    nbytes = row_bytes(t, shape[-1])
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    n_rows = int(np.prod(shape[:-1], dtype=np.int64))
    if data.size != n_rows * nbytes:
        raise ConfigurationError(f"{data.size} bytes are not a {t.name} tensor of shape "
                                 f"{shape} ({n_rows * nbytes} bytes)")
    rows = data.reshape(n_rows, nbytes)
    out = gq.dequantize(rows, t)
    return np.asarray(out, dtype=np.float32).reshape(shape)


# -- K quantizers: blocks [n, 256] float32 -> [n, block bytes] uint8 --------------------------

def _fp16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the fp16 bytes [n, 2], the value the decoder will read back as float32)."""
    h = v.astype(np.float16)
    return h.reshape(-1, 1).view(np.uint8), h.astype(np.float32)


def _inverse(v: np.ndarray) -> np.ndarray:
    out = np.zeros_like(v)
    np.divide(1.0, v, out=out, where=v != 0)
    return out


def _best(err: np.ndarray, cand: tuple[np.ndarray, ...], best: list | None) -> list:
    """Keep, per sub-block, the candidate (err, *values) with the smaller squared error."""
    if best is None:
        return [err, *cand]
    better = err < best[0]
    return [np.where(better, new, old) for new, old in zip((err, *cand), best, strict=True)]


def _asym_levels(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block (x [n, 8, 32]) scale >= 0 and min <= 0 with x ~ scale * L + min: for a few
    level counts around nmax (make_qkx2_quants' search, shortened), levels from min/max, then
    scale and min refitted by least squares; the fit with the smallest error wins."""
    lo = np.minimum(x.min(axis=2), 0.0)
    span = x.max(axis=2) - lo
    n, sx = x.shape[2], x.sum(axis=2)
    best = None
    for delta in _SEARCH:
        levels = np.rint((x - lo[..., None]) * ((nmax + delta) * _inverse(span))[..., None])
        np.clip(levels, 0, nmax, out=levels)
        sl, sll = levels.sum(axis=2), np.einsum("bjk,bjk->bj", levels, levels)
        sxl = np.einsum("bjk,bjk->bj", x, levels)
        det = n * sll - sl * sl
        safe = np.where(det > 0, det, 1.0)
        scale = (n * sxl - sl * sx) / safe
        mn = (sll * sx - sl * sxl) / safe
        # min is stored as -dmin * m with m >= 0: where the fit wants min > 0, refit with min = 0
        pos = mn > 0
        scale = np.where(pos, sxl * _inverse(sll), scale)
        mn = np.where(pos, 0.0, mn)
        use = (det > 0) & (scale > 0)
        scale, mn = np.where(use, scale, span / nmax), np.where(use, mn, lo)
        r = scale[..., None] * levels + mn[..., None] - x
        best = _best(np.einsum("bjk,bjk->bj", r, r), (scale, mn), best)
    return best[1], best[2]


def _sym_scales(x: np.ndarray) -> np.ndarray:
    """Q6_K's per sub-block (x [n, 16, 16]) signed scale: the value of largest magnitude maps to
    about level -32 (make_qx_quants' choice, a few candidates), refitted by least squares."""
    peak = np.take_along_axis(x, np.abs(x).argmax(axis=2)[..., None], axis=2)[..., 0]
    best = None
    for delta in _SEARCH:
        scale = -peak / (32 + delta)
        levels = np.clip(np.rint(x * _inverse(scale)[..., None]), -32, 31)
        sll = np.einsum("bjk,bjk->bj", levels, levels)
        scale = np.where(sll > 0, np.einsum("bjk,bjk->bj", x, levels) * _inverse(sll), scale)
        r = scale[..., None] * levels - x
        best = _best(np.einsum("bjk,bjk->bj", r, r), (scale,), best)
    return best[1]


def _pack_scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit scales and mins of 8 sub-blocks -> the 12 bytes of get_scale_min_k4's layout."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return out


def _asym_k(blocks: np.ndarray, nmax: int) -> tuple[np.ndarray, ...]:
    """Shared part of Q4_K / Q5_K: header bytes (d, dmin, scales) and levels [n, 8, 32]."""
    x = blocks.reshape(-1, 8, 32)
    scale, lo = _asym_levels(x, nmax)
    d_raw, d = _fp16(scale.max(axis=1) / 63)
    dmin_raw, dmin = _fp16(-lo.min(axis=1) / 63)
    sc = np.clip(np.rint(scale * _inverse(d)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(-lo * _inverse(dmin)[:, None]), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    offset = dmin[:, None] * m
    levels = np.rint((x + offset[..., None]) * _inverse(step)[..., None])
    np.clip(levels, 0, nmax, out=levels)
    return d_raw, dmin_raw, _pack_scales_mins(sc, m), levels.astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Levels [n, 8, 32] -> 128 bytes: per 64 weights, low nibbles the first 32, high the next."""
    q4 = (q & 0xF).reshape(-1, 4, 2, 32)
    return (q4[:, :, 0] | (q4[:, :, 1] << 4)).reshape(-1, 128)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _asym_k(blocks, 15)
    return np.concatenate([d, dmin, scales, _nibbles(q)], axis=1)


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _asym_k(blocks, 31)
    bits = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(bits, axis=1).astype(np.uint8)  # bit j: sub-block j
    return np.concatenate([d, dmin, scales, qh, _nibbles(q)], axis=1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    x = blocks.reshape(-1, 16, 16)
    scale = _sym_scales(x)
    top = np.take_along_axis(scale, np.abs(scale).argmax(axis=1)[:, None], axis=1)[:, 0]
    d_raw, d = _fp16(-top / 128)
    sc = np.clip(np.rint(scale * _inverse(d)[:, None]), -128, 127)
    step = d[:, None] * sc
    q = np.clip(np.rint(x * _inverse(step)[..., None]), -32, 31).astype(np.int8)
    q = (q + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [half of 128, quarter, 32]
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6))
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                           sc.astype(np.int8).view(np.uint8), d_raw], axis=1)


_K_QUANTIZERS = {T.Q4_K: _quantize_q4_k, T.Q5_K: _quantize_q5_k, T.Q6_K: _quantize_q6_k}
