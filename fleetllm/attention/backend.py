"""Paged attention: C kernels on the CPU, PyTorch SDPA elsewhere (CUDA, or no C++ compiler).

KV cache, one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]; slot
s = block * block_size + offset, so a step's K/V write is one index op on a flat slot view.
The batch is a flat token list, decode sequences first; the step's metadata holds what its
shape derives, and each layer only writes its K/V and attends. On CPU (float32, bfloat16)
`cpu_kernels.paged_decode` and `prefill_attention` read contexts in place from the blocks;
elsewhere decode groups sequences by context length and gathers each group's context, and
prefill pads similar spans into one causal SDPA call (a gathered context and an explicit mask
after a cached prefix). Sliding windows (Mistral) mask keys outside (p - window, p].
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fleetllm import envs
from fleetllm.kernels import cpu_kernels

logger = logging.getLogger(__name__)

# Spans (or decode contexts) join a padded group while at least this fraction of its longest.
_GROUP_RATIO = 0.75


@dataclass
class PrefillSpan:
    q_start: int  # first of this sequence's tokens in the flat batch
    q_len: int
    ctx_len: int  # tokens attended to: cached prefix + the q_len new ones
    ctx_slots: torch.Tensor | None  # cache slots of all ctx_len tokens; None when no prefix


@dataclass
class DecodeBatch:
    """The step's decode sequences, rows [0, num) of the flat batch. int32 tensors in the
    kernel's form: concatenated block tables, where each sequence's starts, context lengths."""

    tables: torch.Tensor
    table_start: torch.Tensor
    ctx_lens: torch.Tensor

    @property
    def num(self) -> int:
        return self.ctx_lens.shape[0]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]: where each new token's K/V is written
    prefills: list[PrefillSpan]
    decode: DecodeBatch | None = None
    # Built by the first layer that needs them, reused by the step's other layers.
    plans: dict = field(default_factory=dict)


class TorchAttentionBackend:
    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | None,
                meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                kv_written: bool = False) -> torch.Tensor:
        """q: [T, H, d]; k, v: [T, KVH, d] (any row strides); returns [T, H, d] contiguous.
        kv_cache None: the profiling run before the cache exists (prefills only). kv_written:
        the caller already wrote k and v at meta.slot_mapping (a fused kernel did)."""
        window = sliding_window
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_cache = v_cache = None
        if kv_cache is not None:
            num_slots = kv_cache.shape[1] * kv_cache.shape[2]
            k_cache = kv_cache[0].view(num_slots, *kv_cache.shape[3:])
            v_cache = kv_cache[1].view(num_slots, *kv_cache.shape[3:])
            if not kv_written:  # (kv_cache_dtype may differ from the model's)
                k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
                v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        n_dec = meta.decode.num if meta.decode is not None else 0
        if n_dec:
            _decode(q[:n_dec], kv_cache, meta, scale, window, out[:n_dec])
        if meta.prefills:
            if (kv_cache is not None and q.stride(-1) == 1 and kv_cache.is_contiguous()
                    and cpu_kernels.usable(q, kv_cache)):
                if "prefill_spans" not in meta.plans:
                    meta.plans["prefill_spans"] = _prefill_spans(meta)
                spans, slots = meta.plans["prefill_spans"]
                cpu_kernels.prefill_attention(q, kv_cache, spans, slots, window, scale, out)
            else:
                _prefill(q, k, v, k_cache, v_cache, meta, scale, window, out)
        return out


# ---------------------------------------------------------------------------------- decode

# Decode where the C kernel does not apply (CUDA; a CPU without it): FLEETLLM_CUDA_DECODE picks
# (tools/cuda_decode_bench.py compares them; figures: docs/performance.md, "On a GPU"):
#   sdpa    groups of similar lengths, SDPA with a bool padding mask and enable_gqa (on CUDA the
#           math backend: a mask rules out FlashAttention, enable_gqa the memory-efficient one).
#   math32  the same groups in float32, GQA without repeating K/V, two bmm (_decode_math32).
#   varlen  one FlashAttention varlen call over every sequence's visible context packed without
#           padding (no mask, GQA native, fp32 sums); CUDA float16 / bfloat16 only (elsewhere a
#           per-sequence SDPA loop, for tests).
#   auto    (default) CPU: sdpa; CUDA: varlen for float16 / bfloat16 where it runs, else math32.
_DECODE_VARIANT = envs.get("FLEETLLM_CUDA_DECODE")
_VARIANTS = ("auto", "sdpa", "math32", "varlen")
if _DECODE_VARIANT not in _VARIANTS:
    raise ValueError(f"FLEETLLM_CUDA_DECODE={_DECODE_VARIANT!r}: not one of {_VARIANTS}")
_HALF = (torch.float16, torch.bfloat16)
_varlen_ok: dict[tuple, bool] = {}


def _decode_variant(q: torch.Tensor) -> str:
    if _DECODE_VARIANT != "auto":
        return _DECODE_VARIANT
    if q.device.type != "cuda":
        return "sdpa"
    return "varlen" if q.dtype in _HALF and _varlen_runs(q) else "math32"


def _varlen_runs(q: torch.Tensor) -> bool:
    """FlashAttention's varlen op runs on this device, dtype and head size (tried once on a
    tiny input: a build without it, an older GPU or an odd head size raise here, not mid-run)."""
    key = (q.device, q.dtype, q.shape[-1], q.shape[-2])
    if key not in _varlen_ok:
        try:
            h, d = q.shape[-2], q.shape[-1]
            x = torch.zeros(2, h, d, dtype=q.dtype, device=q.device)
            cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=q.device)
            _flash_varlen(x, x, x, cu, 1, 1.0)
            _varlen_ok[key] = True
        except Exception as e:  # noqa: BLE001 - any failure means: use math32
            logger.warning("FlashAttention varlen decode unavailable (%s); using math32",
                           str(e)[:300])
            _varlen_ok[key] = False
    return _varlen_ok[key]


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            window: int | None, out: torch.Tensor) -> None:
    dec = meta.decode
    if (q.stride(-1) == 1 and kv_cache.is_contiguous() and cpu_kernels.usable(q, kv_cache)):
        cpu_kernels.paged_decode(q, kv_cache, dec.tables, dec.table_start, dec.ctx_lens,
                                 window, scale, out)
        return
    variant = _decode_variant(q)
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    k_cache = kv_cache[0].view(num_slots, *kv_cache.shape[3:])
    v_cache = kv_cache[1].view(num_slots, *kv_cache.shape[3:])
    if variant == "varlen":
        key = ("decode_packed", window, kv_cache.shape[2])
        if key not in meta.plans:
            meta.plans[key] = _decode_packed(dec, kv_cache.shape[2], window, q.device)
        slots, cu_k, max_k = meta.plans[key]
        keys, values = (c.index_select(0, slots).to(q.dtype) for c in (k_cache, v_cache))
        out.copy_(_flash_varlen(q, keys, values, cu_k, max_k, scale))
        return
    key = ("decode", window, kv_cache.shape[2])
    if key not in meta.plans:
        meta.plans[key] = _decode_groups(dec, kv_cache.shape[2], window, q.device)
    for rows, slots, mask in meta.plans[key]:
        b, t = slots.shape
        qg = q.index_select(0, rows)
        if variant == "math32":
            o = _decode_math32(qg, k_cache, v_cache, slots, mask, scale)
        else:  # "sdpa"
            keys = k_cache.index_select(0, slots.view(-1)).view(b, t, *k_cache.shape[1:])
            values = v_cache.index_select(0, slots.view(-1)).view(b, t, *v_cache.shape[1:])
            keys, values = keys.to(q.dtype), values.to(q.dtype)
            o = F.scaled_dot_product_attention(qg.unsqueeze(2), keys.transpose(1, 2),
                                               values.transpose(1, 2), attn_mask=mask,
                                               scale=scale, enable_gqa=True).squeeze(2)
        out.index_copy_(0, rows, o)


def _decode_math32(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence, GQA without repeating K/V, in float32: q [b, H, d] ->
    [kvh * b, g, d] and K/V gathered head-major, [kvh * b, t, d], so both products are plain
    bmm. Query head h reads KV head h // g, as enable_gqa and transformers do."""
    b, t = slots.shape
    heads, d = q.shape[1], q.shape[2]
    kvh = k_cache.shape[1]
    g = heads // kvh
    f32 = torch.float32
    keys, values = (c.transpose(0, 1).index_select(1, slots.view(-1)).view(kvh * b, t, d)
                    .to(f32) for c in (k_cache, v_cache))
    qh = q.view(b, kvh, g, d).transpose(0, 1).reshape(kvh * b, g, d).to(f32)
    scores = torch.bmm(qh, keys.transpose(1, 2)).view(kvh, b, g, t)
    scores = scores.mul_(scale).masked_fill_(~mask.view(1, b, 1, t), float("-inf"))
    probs = scores.softmax(-1).view(kvh * b, g, t)
    o = torch.bmm(probs, values).view(kvh, b, g, d).transpose(0, 1).reshape(b, heads, d)
    return o.to(q.dtype)


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_k: torch.Tensor,
                  max_k: int, scale: float) -> torch.Tensor:
    """q [b, H, d], one query per sequence; k, v [sum of lengths, KVH, d], sequence i's keys at
    rows cu_k[i]:cu_k[i + 1]. Returns [b, H, d]."""
    b = q.shape[0]
    if q.device.type == "cuda":
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)
        return torch.ops.aten._flash_attention_forward(
            q.contiguous(), k, v, cu_q, cu_k, 1, max_k, 0.0, False, False, scale=scale)[0]
    # Elsewhere (tests of the packing on CPU): the same attention one sequence at a time.
    bounds = cu_k.tolist()
    return torch.cat([F.scaled_dot_product_attention(
        q[i, :, None][None], k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None],
        scale=scale, enable_gqa=True)[0, :, 0][None]
        for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))])


def _visible(dec: DecodeBatch, window: int | None) -> tuple[list[int], list[int]]:
    """Per decode sequence: its context length and its first visible position."""
    lens = dec.ctx_lens.tolist()
    return lens, [max(0, n - window) if window else 0 for n in lens]


def _slots_of(dec: DecodeBatch, block_size: int, seq: torch.Tensor, pos: torch.Tensor
              ) -> torch.Tensor:
    """Cache slots of positions `pos` of decode sequences `seq` (broadcast), vectorized."""
    tables = dec.tables.to(dtype=torch.long)
    starts = dec.table_start.to(dtype=torch.long)
    return tables[starts[seq] + pos // block_size] * block_size + pos % block_size


def _decode_packed(dec: DecodeBatch, block_size: int, window: int | None,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Visible positions back to back: (cache slots, cumulative lengths [b + 1] int32, max)."""
    lens, first = _visible(dec, window)
    vis = [n - f for n, f in zip(lens, first, strict=True)]
    total = sum(vis)
    vis_t = torch.tensor(vis, device=device)
    cu = torch.zeros(len(vis) + 1, dtype=torch.long, device=device)
    torch.cumsum(vis_t, 0, out=cu[1:])
    seq = torch.repeat_interleave(torch.arange(len(vis), device=device), vis_t,
                                  output_size=total)
    pos = (torch.arange(total, device=device) - cu[seq]
           + torch.tensor(first, device=device)[seq])
    return _slots_of(dec, block_size, seq, pos), cu.to(torch.int32), max(vis)


def _decode_groups(dec: DecodeBatch, block_size: int, window: int | None,
                   device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Per group of similar context lengths, in a few vectorized ops (no loop over sequences):
    (decode rows, cache slots [b, t] of the visible positions padded with a real one, mask)."""
    lens, first = _visible(dec, window)
    order = sorted(range(len(lens)), key=lambda i: lens[i] - first[i], reverse=True)
    groups = []
    for members in _similar(order, [n - f for n, f in zip(lens, first, strict=True)]):
        t = lens[members[0]] - first[members[0]]
        rows = torch.tensor(members, device=device)
        f = torch.tensor([first[i] for i in members], device=device)[:, None]
        n = torch.tensor([lens[i] for i in members], device=device)[:, None]
        pos = f + torch.arange(t, device=device)
        visible = pos < n
        pos = torch.where(visible, pos, f)
        groups.append((rows, _slots_of(dec, block_size, rows[:, None], pos),
                       visible[:, None, None, :]))
    return groups


def _similar(order: list[int], lengths: list[int]) -> list[list[int]]:
    """Split indices sorted by decreasing length into runs whose lengths stay within
    _GROUP_RATIO of the run's first (longest)."""
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] >= _GROUP_RATIO * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


# --------------------------------------------------------------------------------- prefill


def _prefill_spans(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The C kernel's form of the step's prompt spans: int32 rows (q_start, q_len, ctx_len,
    slot_start) and every span's context slots concatenated (int64)."""
    rows, slots, at = [], [], 0
    for s in meta.prefills:
        ctx = (meta.slot_mapping[s.q_start:s.q_start + s.q_len] if s.ctx_slots is None
               else s.ctx_slots)
        rows.append((s.q_start, s.q_len, s.ctx_len, at))
        slots.append(ctx)
        at += s.ctx_len
    return (torch.tensor(rows, dtype=torch.int32),
            torch.cat(slots).to(dtype=torch.int64, device="cpu"))


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor | None,
             v_cache: torch.Tensor | None, meta: AttentionMetadata, scale: float,
             window: int | None, out: torch.Tensor) -> None:
    key = ("prefill", window)
    if key not in meta.plans:
        meta.plans[key] = _prefill_plan(meta.prefills, window, q.device)
    for kind, *args in meta.plans[key]:
        if kind == "one":  # a single fresh span: attended in place, no gather
            start, length = args
            rows = slice(start, start + length)
            out[rows] = _attend(q[rows], k[rows], v[rows], 0, scale, window)
        elif kind == "fresh":
            idx, src, dst, mask = args
            b, t = idx.shape
            qp, kp, vp = (x.index_select(0, idx.view(-1)).view(b, t, *x.shape[1:])
                          .transpose(1, 2) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask,
                                               is_causal=mask is None, scale=scale,
                                               enable_gqa=True)
            out.index_copy_(0, dst, o.transpose(1, 2).reshape(b * t, *q.shape[1:])
                            .index_select(0, src))
        else:  # "prefix": queries over contexts read from the cache
            idx, slots, src, dst, mask = args
            b, t = idx.shape
            qp = q.index_select(0, idx.view(-1)).view(b, t, *q.shape[1:]).transpose(1, 2)
            kp, vp = (c.index_select(0, slots.view(-1)).view(*slots.shape, *c.shape[1:])
                      .transpose(1, 2).to(q.dtype) for c in (k_cache, v_cache))
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
            out.index_copy_(0, dst, o.transpose(1, 2).reshape(b * t, *q.shape[1:])
                            .index_select(0, src))


def _padded_rows(spans: list[PrefillSpan], device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch rows [b, t] of the spans' queries right-padded to the longest (a pad repeats the
    span's last row), and (src, dst): valid padded positions -> their rows in the batch."""
    t = max(s.q_len for s in spans)
    col = torch.arange(t, device=device)
    starts = torch.tensor([s.q_start for s in spans], device=device).unsqueeze(1)
    lens = torch.tensor([s.q_len for s in spans], device=device).unsqueeze(1)
    idx = starts + torch.minimum(col, lens - 1)
    src = (col < lens).view(-1).nonzero().squeeze(1)
    return idx, src, idx.view(-1).index_select(0, src)


def _prefill_plan(spans: list[PrefillSpan], window: int | None, device: torch.device
                  ) -> list[tuple]:
    plan: list[tuple] = []
    fresh = [s for s in spans if s.ctx_slots is None]
    order = sorted(range(len(fresh)), key=lambda i: fresh[i].q_len, reverse=True)
    for members in _similar(order, [s.q_len for s in fresh]):
        group = [fresh[i] for i in members]
        if len(group) == 1:
            plan.append(("one", group[0].q_start, group[0].q_len))
            continue
        idx, src, dst = _padded_rows(group, device)
        t = idx.shape[1]
        mask = None  # causal; with a window, the shared [t, t] band
        if window is not None and window < t:
            i = torch.arange(t, device=device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        plan.append(("fresh", idx, src, dst, mask))
    cached = [s for s in spans if s.ctx_slots is not None]
    if cached:
        plan.append(("prefix", *_prefix_group(cached, window, device)))
    return plan


def _prefix_group(spans: list[PrefillSpan], window: int | None, device: torch.device
                  ) -> tuple[torch.Tensor, ...]:
    """Queries after a cached prefix: padded rows, the padded context slots [b, tk] (with a
    window, from the first key the first query sees), and the mask [b, 1, tq, tk]."""
    idx, src, dst = _padded_rows(spans, device)
    tq = idx.shape[1]
    skips = [0 if window is None else max(0, s.ctx_len - s.q_len - window + 1) for s in spans]
    slot_lists = [s.ctx_slots[skip:] for s, skip in zip(spans, skips, strict=True)]
    slots = torch.nn.utils.rnn.pad_sequence(slot_lists, batch_first=True, padding_value=0)
    klen = torch.tensor([len(x) for x in slot_lists], device=device)[:, None, None]
    qlen = torch.tensor([s.q_len for s in spans], device=device)[:, None, None]
    i = torch.arange(tq, device=device)[None, :, None]  # query index within its span
    j = torch.arange(slots.shape[1], device=device)[None, None, :]
    pos = klen - qlen + i  # the query's key index
    mask = (j <= pos) & (j < klen)
    if window is not None:
        mask &= j > pos - window
    mask |= (i >= qlen) & (j == 0)  # padded queries see one key: no empty softmax row
    return idx, slots.to(device), src, dst, mask.unsqueeze(1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float,
            window: int | None = None) -> torch.Tensor:
    """Causal attention of q (the last len(q) of len(k) positions) over k, v; with a window,
    query i (at key index prefix + i) sees the keys in (prefix + i - window, prefix + i]."""
    # 4-D [1, heads, t, d]: PyTorch's CPU flash attention, as transformers calls it (3-D
    # inputs take another kernel, which rounds bfloat16 differently).
    q_, k_, v_ = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if prefix == 0 and (window is None or window >= q.shape[0]):
        o = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale,
                                           enable_gqa=True)
    else:
        pos = torch.arange(q.shape[0], device=q.device).unsqueeze(1) + prefix
        j = torch.arange(k.shape[0], device=q.device).unsqueeze(0)
        mask = j <= pos
        if window is not None:
            mask &= j > pos - window
        o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
    return o[0].transpose(0, 1)
