"""A quantized projection's packed copy: GGUF's blocks as the file stores them, behind a small
header, in one uint8 tensor the C ops read (csrc/quant.h; linear_kernels.Gguf).

Layout: int64 words [magic, K, parts, perm offset, then per part (type id, rows, row bytes,
byte offset)], then the permutation (if any) and each part's rows, 64-byte aligned. perm
(GPTQ's act-order; perm offset 0: none) is int64 [K]: stored column i multiplies x's column
perm[i], y = W x[:, perm]^T; every part of a copy shares it. A merged projection (q/k/v,
gate/up) is one copy of several parts, which may differ in type (Q4_K_M files give some
layers' v Q6_K). `QuantTensor` is one checkpoint tensor's raw blocks (memory-mapped) with the
slicing that tensor parallelism needs: whole rows, or whole blocks of columns (a block never
straddles ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

MAGIC = 0x324B4341505146  # "FQPACK2": csrc/quant.h QPACK_MAGIC
INT8_ACTS = 1 << 32  # in the parts word: W8A8 (csrc/quant.h QPACK_INT8_ACTS)
HEAD = 4  # magic, K, parts, perm offset
MAX_PARTS = 4


class QType(IntEnum):
    """The ggml tensor types fleetllm reads (gguf.GGMLQuantizationType's ids; gguf itself is
    imported only where a file is read or written: ~0.2 s), and fleetllm's own zero-point types
    (ZERO_POINT: never in a GGUF file), which hold AWQ / GPTQ weights exactly: per block of 32,
    fp16 d, uint8 z, a pad byte, then Q4_0's nibbles (Q4_ZP) or 32 uint8 (Q8_ZP); w = d (q - z)
    (csrc/quant.h)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30
    Q4_ZP = 200
    Q8_ZP = 201


# (elements, bytes) of a block: gguf.GGML_QUANT_SIZES
BLOCK = {QType.F32: (1, 4), QType.F16: (1, 2), QType.BF16: (1, 2), QType.Q4_0: (32, 18),
         QType.Q4_1: (32, 20), QType.Q5_0: (32, 22), QType.Q5_1: (32, 24),
         QType.Q8_0: (32, 34), QType.Q4_K: (256, 144), QType.Q5_K: (256, 176),
         QType.Q6_K: (256, 210), QType.Q4_ZP: (32, 20), QType.Q8_ZP: (32, 36)}
PLAIN = frozenset({QType.F32, QType.F16, QType.BF16})
ZERO_POINT = frozenset({QType.Q4_ZP, QType.Q8_ZP})  # fleetllm's: gguf does not know them


@dataclass
class QuantTensor:
    """One tensor's blocks: raw uint8 [rows, row bytes] (a view of the memory-mapped file) of
    ggml type `qtype`, logically float [rows, cols]; with `perm` (int64 [cols], act-order),
    stored column i is the logical column perm[i]."""

    raw: np.ndarray
    qtype: QType
    shape: tuple[int, int]
    perm: np.ndarray | None = None
    # W8A8: Q8_0 with one scale a row, whose GEMMs quantize x per row to int8 as the format
    # does (quant_ops.cpp's int8_linear); a copy is flagged when all its parts are
    int8_activations: bool = False

    def __post_init__(self) -> None:
        self.qtype = QType(self.qtype)
        if self.perm is not None:
            self.perm = np.asarray(self.perm, dtype=np.int64)
            cols = self.shape[1]
            if self.perm.shape != (cols,) or not np.array_equal(np.sort(self.perm),
                                                                np.arange(cols)):
                raise ValueError(f"perm must be a permutation of the {cols} columns")

    @property
    def block(self) -> tuple[int, int]:
        return BLOCK[self.qtype]

    @property
    def quantized(self) -> bool:
        return self.qtype not in PLAIN

    def narrow(self, dim: int, start: int, length: int) -> QuantTensor:
        """Rows (dim 0) or columns (dim 1) [start, start + length): columns in whole blocks."""
        rows, cols = self.shape
        if dim == 0:
            return QuantTensor(self.raw[start:start + length], self.qtype, (length, cols),
                               self.perm, self.int8_activations)
        if self.perm is not None:
            raise ValueError("columns of a tensor with a column permutation (act-order) "
                             "cannot be split: its stored columns are not the logical ones")
        elems, nbytes = self.block
        if start % elems or length % elems:
            raise ValueError(f"columns [{start}, {start + length}) of a {self.qtype.name} "
                             f"tensor split its blocks of {elems}: this tensor-parallel size "
                             "does not divide its blocks")
        b0, nb = start // elems, length // elems
        return QuantTensor(self.raw[:, b0 * nbytes:(b0 + nb) * nbytes], self.qtype,
                           (rows, length), None, self.int8_activations)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols] in the logical (x's) column order: gguf's reference
        dequantization (numpy; the zero-point types' here), its columns moved by perm."""
        raw = np.ascontiguousarray(self.raw)
        if self.qtype in ZERO_POINT:
            stored = _dequantize_zero_point(raw, self.qtype).reshape(self.shape)
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize
            stored = np.array(dequantize(raw, GGMLQuantizationType(int(self.qtype))),
                              dtype=np.float32).reshape(self.shape)
        if self.perm is None:
            return torch.from_numpy(stored)
        out = np.empty_like(stored)
        out[:, self.perm] = stored
        return torch.from_numpy(out)


def _dequantize_zero_point(raw: np.ndarray, qtype: QType) -> np.ndarray:
    """Q4_ZP / Q8_ZP blocks as float32 [blocks, 32]: d * (q - z), exact in float32 (as the
    kernels compute it)."""
    blocks = raw.reshape(-1, BLOCK[qtype][1])
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)
    z = blocks[:, 2:3].astype(np.float32)
    q = blocks[:, 4:]
    if qtype == QType.Q4_ZP:  # byte j: element j low, element j + 16 high
        q = np.concatenate([q & 0xF, q >> 4], axis=1)
    return d * (q.astype(np.float32) - z)


def pack(parts: list[QuantTensor]) -> torch.Tensor:
    """The packed copy of parts stacked by rows (all of one column count and one perm)."""
    if not 0 < len(parts) <= MAX_PARTS:
        raise ValueError(f"a packed copy holds 1 to {MAX_PARTS} parts, got {len(parts)}")
    cols, perm = parts[0].shape[1], parts[0].perm
    if any(p.shape[1] != cols for p in parts):
        raise ValueError(f"parts of one projection differ in columns: {[p.shape for p in parts]}")
    if any((p.perm is None) != (perm is None) or
           (perm is not None and not np.array_equal(p.perm, perm)) for p in parts):
        raise ValueError("parts of one projection differ in their column permutation")
    offset = -(-8 * (HEAD + 4 * len(parts)) // 64) * 64
    perm_offset = offset if perm is not None else 0
    if perm is not None:
        offset += -(-8 * cols // 64) * 64
    offsets = []
    for p in parts:
        offsets.append(offset)
        offset += -(-p.raw.size // 64) * 64
    out = torch.zeros(offset, dtype=torch.uint8)
    buf = out.numpy()
    int8_acts = all(p.int8_activations and p.qtype == QType.Q8_0 for p in parts)
    words = [MAGIC, cols, len(parts) | (INT8_ACTS if int8_acts else 0), perm_offset]
    for p, off in zip(parts, offsets, strict=True):
        words += [int(p.qtype), p.shape[0], p.raw.shape[1], off]
        buf[off:off + p.raw.size] = p.raw.reshape(-1)  # from the mapping, one copy
    if perm is not None:
        buf[perm_offset:perm_offset + 8 * cols] = perm.astype("<i8").view(np.uint8)
    buf[:8 * len(words)] = np.array(words, dtype="<i8").view(np.uint8)
    return out


def unpack(packed: torch.Tensor) -> list[QuantTensor]:
    """The parts of a packed copy (views of it; each with the copy's perm)."""
    buf = packed.numpy()
    words = buf[:8 * HEAD].view("<i8").tolist()
    if len(words) < HEAD or words[0] != MAGIC:
        raise ValueError("not a packed quantized weight")
    cols, n, perm_offset = words[1], words[2] & (INT8_ACTS - 1), words[3]
    int8_acts = bool(words[2] & INT8_ACTS)
    head = buf[:8 * (HEAD + 4 * n)].view("<i8").tolist()[HEAD:]
    perm = buf[perm_offset:perm_offset + 8 * cols].view("<i8") if perm_offset else None
    parts = []
    for i in range(n):
        qtype, rows, row_bytes, off = head[4 * i:4 * i + 4]
        raw = buf[off:off + rows * row_bytes].reshape(rows, row_bytes)
        parts.append(QuantTensor(raw, QType(qtype), (rows, cols), perm, int8_acts))
    return parts


def int8_activations(packed: torch.Tensor) -> bool:
    """Whether a packed copy is flagged W8A8 (its x quantized to int8 per row)."""
    return bool(int(packed[16:24].numpy().view("<i8")[0]) & INT8_ACTS)


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as W8A8 quantizes it (csrc/quant_ops.cpp's int8_levels): each row's int8 levels
    (scale max |x| / 127) times its scale, in float32."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127
    return torch.round(xf / scale.clamp_min(torch.finfo(torch.float32).tiny)) * scale


def dequantize_packed(packed: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of a packed copy in x's column order (the PyTorch path, checks,
    sharded_state's dense form)."""
    return torch.cat([p.dequantize() for p in unpack(packed)])
