"""The tensors of an AWQ, GPTQ or compressed-tensors checkpoint (config_quant.py reads its
config) for the loader: each quantized projection as one GroupQuant (quant/groups.py: its
integers, scales, zeros and g_idx, unpacked from the format's int32 words) under the
projection's `.weight` name; every other tensor (embeddings, norms, biases, an unquantized
LM head) as the safetensors slice it is. A projection is recognized by its tensors, whatever
the config's targets say: `qweight` (AWQ, GPTQ), `weight_packed` (compressed-tensors
pack-quantized) or an int8 `weight` (int-quantized).

Layouts (the int32 words hold 32 / bits values, the first in the low bits):
- AWQ "gemm": qweight [K, N/8], packed along N in the order 0 2 4 6 1 3 5 7; qzeros [G, N/8]
  likewise; scales [G, N]; w = (q - z) s.
- GPTQ: qweight [K bits/32, N], packed along K; qzeros [G, N bits/32], packed along N (format
  "gptq" stores z - 1); scales [G, N]; g_idx [K] (act-order: not sorted).
- compressed-tensors: weight_packed [N, K bits/32] along K, values offset by 2^(bits-1);
  weight_scale [N, G]; weight_zero_point (asym) packed along N [N bits/32, G]; weight_g_idx
  [K]; int-quantized: weight int8 [N, K], weight_scale [N, 1].
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from fleetllm.config_quant import QuantConfig
from fleetllm.quant.groups import GroupQuant

AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of 8 is the word's value AWQ_ORDER[j]
# The tensors that are part of a quantized projection, by the name's last component
_PRIMARY = ("qweight", "weight_packed")
_PARTS = frozenset({"qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale",
                    "weight_shape", "weight_zero_point", "weight_g_idx", "input_scale",
                    "input_zero_point"})
_WORDS = frozenset({"qweight", "qzeros", "weight_packed"})  # int32 words of packed values
_INDEX = frozenset({"g_idx", "weight_g_idx", "weight_shape", "weight_zero_point"})  # integers


def tensors(files: list[Path], quant: QuantConfig) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for the model's load_weight, in file order. Raises KeyError/ValueError
    naming the tensor for a missing or misshapen part (the loader makes it a ModelLoadError)."""
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
        where = {name: h for h in handles for name in h.keys()}
        for name, handle in where.items():
            prefix, _, last = name.rpartition(".")
            if last == "weight" and f"{prefix}.weight_scale" in where:  # int-quantized
                yield name, _int8(prefix, where, quant.int8_activations)
            elif last in _PRIMARY:
                read = _awq if quant.method == "awq" else _gptq if quant.method == "gptq" \
                    else _packed
                yield f"{prefix}.weight", read(prefix, where, quant)
            elif last not in _PARTS:
                yield name, handle.get_slice(name)


def _get(where: dict[str, Any], prefix: str, last: str, required: bool = True
         ) -> np.ndarray | None:
    name = f"{prefix}.{last}"
    if name not in where:
        if required:
            raise KeyError(f"{name} is missing (a quantized projection needs it)")
        return None
    t = where[name].get_tensor(name)
    if last in _WORDS:
        ok = t.dtype == torch.int32
    else:  # integers where they index or count, floats (scales) elsewhere
        ok = t.is_floating_point() != (last in _INDEX)
    if not ok:
        raise ValueError(f"{name} has dtype {t.dtype}, which this format does not store there")
    return (t.float() if t.is_floating_point() else t).numpy()


def unpack(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """The values packed in int32 words along axis (32 / bits per word, the first in the low
    bits), as uint8."""
    w = np.ascontiguousarray(words).view(np.uint32)
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    if axis == 0:
        out = (w[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return out.reshape(-1, w.shape[1]).astype(np.uint8)
    out = (w[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)
    return out.reshape(w.shape[0], -1).astype(np.uint8)


def _groups(k: int, n_groups: int, g_idx: np.ndarray | None, prefix: str) -> np.ndarray:
    """Each column's group: g_idx as stored, or consecutive groups of K / G columns."""
    if g_idx is not None:
        g = g_idx.astype(np.int64).reshape(-1)
        if g.shape != (k,) or g.min(initial=0) < 0 or g.max(initial=0) >= n_groups:
            raise ValueError(f"{prefix}: g_idx must be [{k}] entries in [0, {n_groups})")
        return g
    if k % n_groups:
        raise ValueError(f"{prefix}: {n_groups} groups do not divide {k} columns")
    return np.arange(k, dtype=np.int64) // (k // n_groups)


def _check(cond: bool, prefix: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{prefix}: {what}")


def _awq(prefix: str, where: dict[str, Any], quant: QuantConfig) -> GroupQuant:
    qweight, qzeros, scales = (_get(where, prefix, t) for t in ("qweight", "qzeros", "scales"))
    order = list(AWQ_ORDER)
    q = unpack(qweight, 4, 1).reshape(qweight.shape[0], -1, 8)[..., order].reshape(
        qweight.shape[0], -1)  # [K, N]
    z = unpack(qzeros, 4, 1).reshape(qzeros.shape[0], -1, 8)[..., order].reshape(
        qzeros.shape[0], -1)  # [G, N]
    _check(scales.shape == z.shape and q.shape[1] == z.shape[1], prefix,
           f"qweight {qweight.shape}, qzeros {qzeros.shape} and scales {scales.shape} disagree")
    return GroupQuant(np.ascontiguousarray(q.T), scales, z.astype(np.int32),
                      _groups(q.shape[0], z.shape[0], None, prefix), 4)


def _gptq(prefix: str, where: dict[str, Any], quant: QuantConfig) -> GroupQuant:
    qweight, qzeros, scales = (_get(where, prefix, t) for t in ("qweight", "qzeros", "scales"))
    bits = quant.bits
    q = unpack(qweight, bits, 0)  # [K, N]
    z = unpack(qzeros, bits, 1).astype(np.int32) + (1 if quant.gptq_v1_zeros else 0)
    _check(scales.shape[1] == q.shape[1] and z.shape[0] == scales.shape[0]
           and z.shape[1] >= q.shape[1], prefix,
           f"qweight {qweight.shape}, qzeros {qzeros.shape} and scales {scales.shape} disagree")
    g = _groups(q.shape[0], scales.shape[0], _get(where, prefix, "g_idx", required=False),
                prefix)
    return GroupQuant(np.ascontiguousarray(q.T), scales, z[:, :q.shape[1]], g, bits)


def _packed(prefix: str, where: dict[str, Any], quant: QuantConfig) -> GroupQuant:
    bits = quant.bits
    packed, scale = _get(where, prefix, "weight_packed"), _get(where, prefix, "weight_scale")
    shape = _get(where, prefix, "weight_shape", required=False)
    q = unpack(packed, bits, 1)  # [N, K'] offset by 2^(bits-1)
    _check(shape is None or shape.shape == (2,), prefix, "weight_shape must be [out, in]")
    n, k = (int(shape[0]), int(shape[1])) if shape is not None else q.shape
    _check(q.shape[0] == n and q.shape[1] >= k and scale.shape[0] == n, prefix,
           f"weight_packed {packed.shape}, weight_shape {(n, k)} and weight_scale "
           f"{scale.shape} disagree")
    q = q[:, :k]
    zp = _get(where, prefix, "weight_zero_point", required=False)
    offset = 1 << (bits - 1)
    if zp is None:
        z = np.full(scale.shape, offset, np.int32)
    elif zp.dtype == np.int32:  # packed along N, offset like the weights
        z = unpack(zp, bits, 0)[:n].astype(np.int32)
    else:  # stored as signed integers
        z = zp.astype(np.int32) + offset
    _check(z.shape == scale.shape, prefix, f"weight_zero_point {zp.shape if zp is not None else ''}"
           f" does not match weight_scale {scale.shape}")
    g = _groups(k, scale.shape[1], _get(where, prefix, "weight_g_idx", required=False), prefix)
    return GroupQuant(np.ascontiguousarray(q), scale.T.copy(), z.T.copy(), g, bits)


def _int8(prefix: str, where: dict[str, Any], int8_activations: bool) -> GroupQuant:
    """compressed-tensors int-quantized: int8 weights, a scale per channel (or group);
    int8_activations (W8A8): the GEMMs quantize x per row, as the format does."""
    w = where[f"{prefix}.weight"].get_tensor(f"{prefix}.weight")
    _check(w.dtype == torch.int8 and w.dim() == 2, prefix, f"weight beside a weight_scale must "
           f"be int8 [out, in], got {w.dtype} {tuple(w.shape)}")
    w = w.numpy()
    scale = _get(where, prefix, "weight_scale")
    scale = scale.reshape(w.shape[0], -1)
    zp = _get(where, prefix, "weight_zero_point", required=False)
    _check(zp is None or not np.any(zp), prefix, "int8 weights with nonzero zero points "
           "(asymmetric) are not supported")
    q = (w.astype(np.int16) + 128).astype(np.uint8)
    g = _groups(w.shape[1], scale.shape[1], None, prefix)
    return GroupQuant(q, scale.T.copy(), np.full(scale.T.shape, 128, np.int32), g, 8,
                      int8_activations)


def dequantized(tensor: Any) -> torch.Tensor:
    """A loaded tensor as float32 (for references and checks)."""
    if isinstance(tensor, GroupQuant):
        return torch.from_numpy(tensor.dequantize())
    return (tensor if isinstance(tensor, torch.Tensor) else tensor[:]).float()
