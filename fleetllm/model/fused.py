"""A decode step runs all its decoder layers in one C call (cpu_kernels.decoder_layers), with
the kernels the modules use (fused norm, RoPE + cache write, paged attention, SiLU * up, each
projection's copy as its kernel reads it: linear_kernels.py), plus the embedding lookup (first
pipeline stage) and the final norm (last stage): Python and the dispatcher are crossed once a
step, not once a layer. Used only where it computes exactly what the modules would: CPU
float32 or bfloat16, no tensor parallelism, no q/k norm, no mixture of experts, the dense
weights kept or all projections packed, a step of decode tokens only; otherwise the modules
run."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fleetllm.attention import AttentionMetadata
from fleetllm.distributed.parallel_state import get_tp_group
from fleetllm.kernels import cpu_kernels
from fleetllm.kernels.cpu_kernels import LinearKind

# The most rows a step takes here (its activations: 76 KiB per row on Qwen2-0.5B shapes).
MAX_ROWS = 256


class _Stack(NamedTuple):
    """What the one C call of a model's layers needs, computed once per model."""

    weights: list  # 10 a layer, the Parameters themselves: sleep level 2 empties them in place
    eps: float
    heads: int
    windows: list[int]
    scale: float
    gemv_rows: int  # up to this many rows the projections take the GEMV kernel
    kernels: tuple  # the kernels of qkv, o, gate_up, down of each layer
    embed: torch.Tensor | None  # the first stage's embedding (looked up in the call), or None
    final_norm: torch.Tensor | None  # the last stage's final norm (applied in the call)
    # By rows: (kind, the packed copies the call reads), or None where the kernels' copies are
    # not all one kind the call reads; gathered at the first step of that many rows, not at
    # every one (48 attribute reads cost ~50 us a step at batch 1, cold after the weights
    # stream). forget() drops them with the stack: sleep level 2 frees the packed copies.
    packed: dict


def _layer_weights(layer, gemv: bool) -> list | None:
    """The layer's 10 weights for the C call, or None if the fused path does not apply.
    gemv: the projections read their dense weights (the GEMV kernel's rows)."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    dense_ok = not gemv or all(m.weight is not None and m.weight.is_contiguous()
                               and cpu_kernels.usable(m.weight) for m in linears)
    if not (dense_ok and attn.q_norm is None
            and layer.input_layernorm.eps == layer.post_attention_layernorm.eps):
        return None
    norm = layer.input_layernorm.weight
    out = [norm, layer.post_attention_layernorm.weight]
    for m in linears:  # packed weights are all that is read past the GEMV (the dense may go)
        out += [norm.new_empty(0) if m.weight is None else m.weight, getattr(m, "bias", None)]
    return out


def _stack(model) -> _Stack | None:
    """The model's _Stack, or None if the fused path does not apply to one of its layers."""
    cached = getattr(model, "_fused_stack", False)
    if cached is not False:
        return cached
    layers = list(model.layers.values())
    if not all(hasattr(layer.mlp, "gate_up_proj") for layer in layers):  # experts: moe.py
        model._fused_stack = None
        return None
    kernels = tuple(m.kernel for layer in layers for m in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
        layer.mlp.down_proj))
    gemv_rows = min((k.decode_rows for k in kernels), default=0)
    weights = [_layer_weights(layer, gemv_rows > 0) for layer in layers]
    attn = [layer.self_attn for layer in layers]
    embed = None
    if model.is_first_stage:  # a GGUF model's quantized embedding: its packed copy
        embed = getattr(model.embed_tokens, "packed", None)
        embed = model.embed_tokens.weight if embed is None else embed
    norm = model.norm if model.is_last_stage else None
    ok = (layers and get_tp_group().world_size == 1
          and all(w is not None for w in weights)
          and len({(a.num_heads, a.scale, layer.input_layernorm.eps)
                   for a, layer in zip(attn, layers, strict=True)}) == 1
          and (embed is None or embed.dtype == torch.uint8
               or embed.is_contiguous() and cpu_kernels.usable(embed))
          and (norm is None or norm.eps == layers[0].input_layernorm.eps))
    model._fused_stack = None
    if ok:
        model._fused_stack = _Stack(
            [t for w in weights for t in w], layers[0].input_layernorm.eps, attn[0].num_heads,
            [a.sliding_window or 0 for a in attn], attn[0].scale, gemv_rows, kernels, embed,
            None if norm is None else norm.weight, {})
    return model._fused_stack


def forget(model) -> None:
    """Drop the model's _Stack and the packed weights it holds (worker.sleep, level 2: they
    are freed there, and a _Stack holding them would keep them alive)."""
    model.__dict__.pop("_fused_stack", None)


def _packed_for(st: _Stack, rows: int) -> tuple[LinearKind, list] | None:
    """(kind, the packed copies) the call reads at `rows` rows: none up to the GEMV's rows;
    None where the projections' kernels do not all read one kind the call reads (an odd K
    keeps oneDNN's copy beside the pairs', say)."""
    if rows <= st.gemv_rows:
        return LinearKind.GEMV, []
    got = st.packed.get(rows)
    if got is None:
        copies = [k.for_rows(rows) for k in st.kernels]
        kinds = {c.kind for c in copies}
        if LinearKind.GGUF in kinds:  # quantized beside dense (unquantized) weights
            dense = all(c.kind == LinearKind.GGUF or (
                c.tensor is not None and c.tensor.dim() == 2 and c.tensor.is_contiguous()
                and cpu_kernels.usable(c.tensor)) for c in copies)
            got = (LinearKind.GGUF, [c.tensor for c in copies]) if dense else False
        else:
            got = (kinds.pop(), [c.tensor for c in copies]) \
                if len(kinds) == 1 and None not in kinds else False
        st.packed[rows] = got
    return got or None


def _fits(x: torch.Tensor, kv_cache: torch.Tensor | None) -> bool:
    """At most MAX_ROWS contiguous rows, and a cache the kernels read. x: the step's token ids
    (int64 [T]) or hidden states ([T, H])."""
    return (kv_cache is not None and x.shape[0] <= MAX_ROWS and x.is_contiguous()
            and kv_cache.is_contiguous()
            and cpu_kernels.usable(kv_cache, *(() if x.dtype == torch.long else (x,))))


def applies(x: torch.Tensor, kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> bool:
    """This step can use the fused layers: decode tokens only, at most MAX_ROWS of them. x: the
    step's token ids (int64 [T]) or hidden states ([T, H])."""
    return (_fits(x, kv_cache) and not meta.prefills and meta.decode is not None
            and meta.decode.num == x.shape[0])


def run_layers(model, positions: torch.Tensor, x: torch.Tensor,
               residual: torch.Tensor | None, kv_caches: list[torch.Tensor],
               meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(output, residual) of the model's layers run in turn, in one C call
    (cpu_kernels.decoder_layers: Python and the dispatcher crossed once a step, not once a
    layer); None when the fused path does not apply (the caller then runs the modules).
    x: the first stage's token ids (int64 [T], embedded in the call) or a later stage's
    hidden states (with their residual). The call looks the positions' rows of RoPE's tables
    up itself. On the last stage the output is the final norm's (the call applies it too)."""
    st = _stack(model)
    if st is None or not applies(x, kv_caches[0], meta):
        return None
    packed = _packed_for(st, x.shape[0])  # past the GEMV kernel's rows, as the modules take them
    if packed is None:
        return None
    kind, packed = packed
    # The first stage (x its token ids, st.embed its embedding) starts the residual; a later
    # stage's comes with its input.
    first = residual is None
    if first:  # hidden size and dtype: the first norm's
        residual = x.new_empty(x.shape[0], st.weights[0].shape[0], dtype=st.weights[0].dtype)
    if len(kv_caches) != len(st.windows):
        kv_caches = kv_caches[:len(st.windows)]  # one a layer, as the modules take them
    dec = meta.decode
    cos, sin = model.rotary.tables(residual.dtype)
    out = cpu_kernels.decoder_layers(
        x, residual, first, st.weights, st.eps, st.heads, st.windows, st.scale, cos, sin,
        kv_caches, meta.slot_mapping, dec.tables, dec.table_start, dec.ctx_lens, packed, kind,
        embed=st.embed, final_norm=st.final_norm, positions=positions)
    return out, residual


def _head(head, rows: int) -> tuple[torch.Tensor, LinearKind, int] | None:
    """What the LM head's kernel reads for the logits of `rows` rows, as greedy_passes takes
    it: (the tensor, its kind, its outputs); None where the call reads no such tensor."""
    kernel = head.kernel
    if rows <= kernel.decode_rows:  # the GEMV kernel's rows, on the dense weight
        weight = head.weight
        return (weight, LinearKind.GEMV, weight.shape[0]) if weight.is_contiguous() and \
            cpu_kernels.usable(weight) else None
    copy = kernel.for_rows(rows)
    return None if copy.kind is None else (copy.tensor, copy.kind, copy.out_features)


def run_passes(model, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               ctx_lens: torch.Tensor, tables: torch.Tensor, table_start: torch.Tensor,
               kv_caches: list[torch.Tensor], stops: torch.Tensor, interrupts: torch.Tensor,
               interrupts_before: int) -> torch.Tensor | None:
    """Up to k greedy decode passes in one C call (cpu_kernels.greedy_passes: the layers'
    call, the LM head and the argmax of each pass, with no Python between passes), for
    worker/greedy_passes.py; the tokens of the passes done (int64 [passes, T]), or None where
    the call does not apply (the model is not all one stage with an LM head on one rank, the
    fused layers do not apply, or the LM head's weight is not one the call reads). ids: the
    rows' last tokens (int64 [T]); positions, slots (int64) and ctx_lens (int32): [k, T];
    the call ends after a pass where interrupts (int64 [1]) no longer holds interrupts_before,
    or after which every row has drawn one of its stop tokens (stops: int64 [T, S])."""
    st = _stack(model)
    rows = ids.shape[0]
    if st is None or st.embed is None or st.final_norm is None or model.lm_head is None or \
            not _fits(ids, kv_caches[0]):
        return None
    packed, head = _packed_for(st, rows), _head(model.lm_head, rows)
    if packed is None or head is None:
        return None
    if len(kv_caches) != len(st.windows):
        kv_caches = kv_caches[:len(st.windows)]
    cos, sin = model.rotary.tables(st.weights[0].dtype)
    (kind, packed), (weight, head_kind, n) = packed, head
    return cpu_kernels.greedy_passes(
        ids, st.weights, st.eps, st.heads, st.windows, st.scale, cos, sin, kv_caches, slots,
        tables, table_start, ctx_lens, packed, kind, positions=positions, embed=st.embed,
        final_norm=st.final_norm, head=weight, head_kind=head_kind, head_n=n, stops=stops,
        interrupts=interrupts, interrupts_before=interrupts_before)
