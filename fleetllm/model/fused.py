"""A decode step of a few sequences runs each decoder layer as one C call
(cpu_kernels.decoder_layer): the same kernels as the module-by-module path (GEMV, fused norm,
RoPE + cache write, paged attention, SiLU * up), minus ~10 Python calls, tensors and their
glue per layer. Used when it computes exactly what the modules would: CPU float32 or
bfloat16 (the KV cache in either), no tensor
parallelism, no q/k norm, the dense weights kept (FLEETLLM_LINEAR=auto), a batch of at most
8 decode tokens (16 for bf16 weights on a CPU without bf16 packing: layers.decode_gemv_rows;
3 for a large bf16 layer on a CPU with it: _BF16_PACKED_LAYER_BYTES) and nothing else."""

from __future__ import annotations

import torch

from fleetllm.attention import AttentionMetadata, cpu_kernels
from fleetllm.distributed.parallel_state import get_tp_group
from fleetllm.model.layers import decode_gemv_rows

# The most rows any layer takes here; each layer's own limit is decode_gemv_rows (the GEMV
# kernel reads each weight once for all rows, 4 at a time from L1).
MAX_ROWS = 16

# Where oneDNN packs bfloat16 (CPUs with AVX-512), its packed matmul beats the GEMV kernel from
# 4 rows on nearly every projection (`tools/cpu_gemv_bench.py --onednn`; 2-core Zen 4: 0.5-0.9
# of the kernel's time at 6-8 rows). The one-call layer still pays for itself where its
# projections are small, the ~10 Python calls per layer it saves costing about what oneDNN
# gains (the 125M preset: 12 MiB per layer, 5-8-row steps as fast either way or faster here);
# above this size, such a layer takes only the steps of up to 3 rows (Qwen2-0.5B shapes, 28 MiB
# per layer: 6-8-row decode steps 57-70 ms through it, 50-58 ms through the modules and
# oneDNN, the LM head's limit set to 3 as well in that measurement). Their hidden states are
# then the same bits for a sequence only in decode batches of up to 3 (oneDNN sums in another
# order than the kernel).
_BF16_PACKED_LAYER_BYTES = 16 << 20
_BF16_PACKED_ROWS = 3


def _weights(layer) -> tuple | None:
    """The layer's weights (the Parameters themselves: sleep level 2 empties them in place, so
    nothing here keeps their memory alive), heads, window, scale and the most rows it takes,
    computed once; or None if the fused path does not apply to this layer."""
    cached = getattr(layer, "_fused", False)
    if cached is not False:
        return cached
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    ok = (get_tp_group().world_size == 1 and attn.q_norm is None
          and all(m.weight is not None and m.weight.is_contiguous()
                  and cpu_kernels.usable(m.weight) for m in linears)
          and layer.input_layernorm.eps == layer.post_attention_layernorm.eps)
    layer._fused = None
    if ok:
        rows = min(decode_gemv_rows(m) for m in linears)
        nbytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
        bf16_packed = all(getattr(m, "packed_weight", None) is not None
                          and m.packed_weight.dtype == torch.bfloat16 for m in linears)
        if bf16_packed and nbytes > _BF16_PACKED_LAYER_BYTES:
            rows = min(rows, _BF16_PACKED_ROWS)
        bias = [getattr(m, "bias", None) for m in linears]
        layer._fused = (
            (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
             layer.input_layernorm.eps, attn.qkv_proj.weight, bias[0], attn.o_proj.weight,
             bias[1], mlp.gate_up_proj.weight, bias[2], mlp.down_proj.weight, bias[3]),
            attn.num_heads, attn.sliding_window or 0, attn.scale, rows)
    return layer._fused


def applies(hidden: torch.Tensor, kv_cache: torch.Tensor | None,
            meta: AttentionMetadata) -> bool:
    """This step can use the fused layers: a small batch of decode tokens only."""
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
    weights, heads, window, scale, max_rows = fused
    if hidden.shape[0] > max_rows:
        return None
    first = residual is None
    if first:
        residual = torch.empty_like(hidden)
    dec = meta.decode
    out = cpu_kernels.decoder_layer(
        hidden, residual, first, weights, heads, window, scale, rope[0], rope[1], kv_cache,
        meta.slot_mapping, dec.tables, dec.table_start, dec.ctx_lens)
    return out, residual
