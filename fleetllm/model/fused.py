"""A decode step runs each decoder layer as one C call (cpu_kernels.decoder_layer): the same
kernels as the module-by-module path (fused norm, RoPE + cache write, paged attention, SiLU *
up; the projections through the GEMV kernel or oneDNN's packed matmul), minus ~10 Python
calls, tensors and their glue per layer. Used when it computes exactly what the modules would:
CPU float32 or bfloat16 (the KV cache in either), no tensor parallelism, no q/k norm, the
dense weights kept (FLEETLLM_LINEAR=auto) or all four projections packed by pairs (their
dense weights are freed: empty tensors stand in), a step of decode tokens only and nothing
else. Up
to a layer's GEMV row limit (8; 16 for bf16 weights on a CPU without bf16 packing; 0 for
weights packed by pairs: layers.decode_gemv_rows) the projections take the GEMV kernel; above
it the packed weights, as the modules would: oneDNN's matmul, or the bf16 GEMM on weights
packed by pairs (model/pair_packed.py), which the C layer calls itself."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fleetllm.attention import AttentionMetadata, cpu_kernels
from fleetllm.distributed.parallel_state import get_tp_group
from fleetllm.model import pair_packed
from fleetllm.model.layers import decode_gemv_rows

# The most rows a step takes here (its activations: 76 KiB per row on Qwen2-0.5B shapes).
MAX_ROWS = 256


class _Layer(NamedTuple):
    """What a layer's one C call needs, computed once per layer."""

    weights: tuple  # the Parameters themselves: sleep level 2 empties them in place
    heads: int
    window: int
    scale: float
    gemv_rows: int  # up to this many rows the projections take the GEMV kernel
    linears: tuple  # qkv, o, gate_up, down: their packed weights are read at each call


def _weights(layer) -> _Layer | None:
    """The layer's _Layer, or None if the fused path does not apply to it."""
    cached = getattr(layer, "_fused", False)
    if cached is not False:
        return cached
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    by_pairs = all(isinstance(getattr(m, "packed_weight", None), pair_packed.PairPacked)
                   for m in linears)  # then the dense weights are not read (and may be gone)
    ok = (get_tp_group().world_size == 1 and attn.q_norm is None
          and (by_pairs or all(m.weight is not None and m.weight.is_contiguous()
                               and cpu_kernels.usable(m.weight) for m in linears))
          and layer.input_layernorm.eps == layer.post_attention_layernorm.eps)
    layer._fused = None
    if ok:
        rows = min(decode_gemv_rows(m) for m in linears)
        bias = [getattr(m, "bias", None) for m in linears]
        norm = layer.input_layernorm.weight
        dense = [norm.new_empty(0) if m.weight is None else m.weight for m in linears]
        layer._fused = _Layer(
            (norm, layer.post_attention_layernorm.weight, layer.input_layernorm.eps, dense[0],
             bias[0], dense[1], bias[1], dense[2], bias[2], dense[3], bias[3]),
            attn.num_heads, attn.sliding_window or 0, attn.scale, rows, linears)
    return layer._fused


def _packed(linears: tuple) -> tuple | None:
    """The projections' packed weights (oneDNN's, or PairPacked's data), or None if one has
    none or they are of both kinds. Read at each call, not kept: sleep level 2 drops them
    (worker.py) and waking builds a new model."""
    packed = tuple(getattr(m, "packed_weight", None) for m in linears)
    kinds = {isinstance(p, pair_packed.PairPacked) for p in packed}
    if any(p is None for p in packed) or len(kinds) > 1:  # (an odd K keeps oneDNN's packing)
        return None
    return tuple(p.data if isinstance(p, pair_packed.PairPacked) else p for p in packed)


def applies(hidden: torch.Tensor, kv_cache: torch.Tensor | None,
            meta: AttentionMetadata) -> bool:
    """This step can use the fused layers: decode tokens only, at most MAX_ROWS of them."""
    return (kv_cache is not None and hidden.shape[0] <= MAX_ROWS and not meta.prefills
            and meta.decode is not None and meta.decode.num == hidden.shape[0]
            and hidden.is_contiguous() and kv_cache.is_contiguous()
            and cpu_kernels.usable(hidden, kv_cache))


def run_layer(layer, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
              residual: torch.Tensor | None, kv_cache: torch.Tensor, meta: AttentionMetadata
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(output, residual) of the layer, or None when the fused path does not apply to it."""
    fused = _weights(layer)
    if fused is None:
        return None
    packed = ()
    if hidden.shape[0] > fused.gemv_rows:  # past the GEMV kernel: the packed weights, as the
        packed = _packed(fused.linears)      # modules take them
        if packed is None:
            return None
    first = residual is None
    if first:
        residual = torch.empty_like(hidden)
    dec = meta.decode
    out = cpu_kernels.decoder_layer(
        hidden, residual, first, fused.weights, fused.heads, fused.window, fused.scale, rope[0],
        rope[1], kv_cache, meta.slot_mapping, dec.tables, dec.table_start, dec.ctx_lens, packed)
    return out, residual
