"""Group-quantized weights (AWQ, GPTQ, compressed-tensors: quant/hf_checkpoint.py reads them)
as GGUF blocks, so that they run on the same packed copies and kernels as a GGUF file.

A `GroupQuant` is one projection's weight, unpacked to integers: w[n, k] = s[g, n] * (q[n, k] -
z[g, n]) with g = g_idx[k]. The layers narrow it for their tensor-parallel shard (rows, or
columns with their g_idx), then `blocks()` writes 32-column GGUF blocks, exactly where the types
allow: Q4_0 (4-bit, every zero 8), Q8_0 (8-bit, every zero 128), else fleetllm's own Q4_ZP /
Q8_ZP (Q4_0's and Q8_0's layouts with the block's integer zero point: w = d (q - z), exact;
Q4_1 would round its minimum -s z to fp16, shifting logprobs by up to 1e-2). Scales are stored
fp16, as the formats store them. Act-order checkpoints (GPTQ
desc_act, whose g_idx is not sorted) have their columns sorted by group and keep the order as
the packed copy's perm (the kernel gathers x's columns to match).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fleetllm.quant.packed import QType, QuantTensor


@dataclass
class GroupQuant:
    """q uint8 [N, K] (unsigned levels), scales float32 [G, N], zeros int32 [G, N], g_idx
    int64 [K] (each column's group), bits 4 or 8."""

    q: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    g_idx: np.ndarray
    bits: int
    int8_activations: bool = False  # W8A8: its GEMMs quantize x per row (packed.QuantTensor)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def narrow(self, dim: int, start: int, length: int) -> GroupQuant:
        """Rows (dim 0) or columns (dim 1) [start, start + length), as layers.narrow."""
        end = start + length
        if dim == 0:
            return GroupQuant(self.q[start:end], self.scales[:, start:end],
                              self.zeros[:, start:end], self.g_idx, self.bits,
                              self.int8_activations)
        return GroupQuant(self.q[:, start:end], self.scales, self.zeros, self.g_idx[start:end],
                          self.bits, self.int8_activations)

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: the checkpoint's own arithmetic (for checks and references)."""
        s, z = self.scales[self.g_idx].T, self.zeros[self.g_idx].T
        return (self.q.astype(np.float32) - z) * s

    def blocks(self) -> QuantTensor:
        """This weight as GGUF blocks (see the module docstring). Raises ValueError when its
        groups do not fill whole 32-column blocks (a group size not a multiple of 32, or a
        tensor-parallel split of an act-order layer that cuts its groups)."""
        n, k = self.q.shape
        q, g, perm = self.q, self.g_idx, None
        if np.any(np.diff(g) < 0):  # act-order: columns sorted by group
            perm = np.argsort(g, kind="stable").astype(np.int64)
            q, g = q[:, perm], g[perm]
        if k % 32 or np.any(g.reshape(-1, 32) != g[::32, None]):
            raise ValueError(f"its quantization groups do not fill whole blocks of 32 columns "
                             f"(in features {k}): fleetllm needs group sizes that are "
                             "multiples of 32, and act-order groups within one "
                             "tensor-parallel shard")
        with np.errstate(over="ignore"):
            s = self.scales[g[::32]].T.astype(np.float16)  # [N, blocks]
        if not np.all(np.isfinite(s)):
            raise ValueError("scales that are not finite in fp16 (GGUF blocks store fp16)")
        z = self.zeros[g[::32]].T
        nb = k // 32
        q = q.reshape(n, nb, 32)
        if self.bits not in (4, 8):
            raise ValueError(f"{self.bits}-bit weights are not supported (4 and 8 are)")
        top = 16 if self.bits == 4 else 255  # GPTQ's format "gptq" can say 16 for 4-bit
        if np.any(z < 0) or np.any(z > top):
            raise ValueError(f"zero points outside [0, {top}]")
        symmetric = np.all(z == (1 << (self.bits - 1)))
        if self.bits == 8:
            body = (q.astype(np.int16) - 128).astype(np.int8).view(np.uint8) if symmetric \
                else q
            qtype = QType.Q8_0 if symmetric else QType.Q8_ZP
        else:
            body = q[..., :16] | (q[..., 16:] << 4)
            qtype = QType.Q4_0 if symmetric else QType.Q4_ZP
        head = [np.ascontiguousarray(s).view(np.uint8).reshape(n, nb, 2)]
        if not symmetric:  # the zero point, then a pad byte
            head.append(np.stack([z.astype(np.uint8), np.zeros_like(z, np.uint8)], axis=2))
        raw = np.concatenate([*head, body.astype(np.uint8)], axis=2).reshape(n, -1)
        per_row = bool(np.all(s == s[:, :1]))  # one scale a row: an int8 GEMM can use it
        int8_acts = self.int8_activations and qtype == QType.Q8_0 and per_row
        return QuantTensor(raw, qtype, self.shape, perm=perm, int8_activations=int8_acts)
