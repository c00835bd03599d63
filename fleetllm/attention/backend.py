"""Paged attention in pure PyTorch (runs on CPU and CUDA).

KV cache layout, one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim].
Slot s = block * block_size + offset. Slot-major rows make the two hot operations single
index ops on a flat [num_slots, kv_heads, head_dim] view: writing this step's K/V, and gathering
a sequence's context (the same layout FlashAttention's paged KV uses). Swaps and copies index
dim 1 (whole blocks).

The batch is a flat list of tokens, no padding between sequences. Sequences with one new
token (decode) are attended together through their block tables; sequences with several
(prefill, chunked prefill, prefill after a cached prefix) one at a time.
A faster kernel (e.g. FlashAttention on CUDA) fits behind the same `forward` signature.

Sliding-window attention (Mistral), as transformers defines it: the query at position p sees
the keys at positions (p - window, p]. Context positions are cache positions (a sequence's
context always starts at position 0), so the window is a mask on them; prefill and decode also
skip the keys no query of theirs can see. Blocks that fell out of the window stay allocated
(the block manager does not know about windows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    q_start: int  # first of this sequence's tokens in the flat batch
    q_len: int
    ctx_len: int  # tokens attended to: cached prefix + the q_len new ones
    ctx_slots: torch.Tensor | None  # cache slots of all ctx_len tokens; None when no prefix


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]: where each new token's K/V is written
    prefills: list[PrefillSpan]
    decode_token_idx: torch.Tensor | None = None  # [B] positions in the flat batch
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks], padded with 0
    decode_ctx_lens: torch.Tensor | None = None  # [B]


class TorchAttentionBackend:
    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | None,
                meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        """q: [T, H, d]; k, v: [T, KVH, d]; returns [T, H, d]. sliding_window: see above."""
        window = sliding_window
        if kv_cache is None:  # profiling run before the cache exists: attend within the batch
            return _prefill_all(q, k, v, meta, scale, window)
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        k_cache = kv_cache[0].view(num_slots, *kv_cache.shape[3:])
        v_cache = kv_cache[1].view(num_slots, *kv_cache.shape[3:])
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            prefix = span.ctx_len - span.q_len
            if span.ctx_slots is None:
                ks, vs = k[rows], v[rows]
            else:
                # With a window, the cached keys before the first query's window are unseen.
                skip = 0 if window is None else max(0, prefix - window + 1)
                slots = span.ctx_slots[skip:]
                ks, vs, prefix = k_cache[slots], v_cache[slots], prefix - skip
            out[rows] = _attend(q[rows], ks, vs, prefix, scale, window)
        if meta.decode_token_idx is not None:
            out[meta.decode_token_idx] = _decode(q[meta.decode_token_idx], kv_cache, meta, scale,
                                                 window)
        return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float,
            window: int | None = None) -> torch.Tensor:
    """Causal attention of q (the last len(q) of len(k) positions) over k, v; with a window,
    query i (at key index prefix + i) sees the keys in (prefix + i - window, prefix + i]."""
    q_, k_, v_ = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
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
    return o.transpose(0, 1)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            window: int | None = None) -> torch.Tensor:
    """One query per sequence over its paged context. q: [B, H, d]. The query is at position
    len - 1; with a window it sees positions [len - window, len)."""
    tables, lens = meta.decode_block_tables, meta.decode_ctx_lens
    b, max_blocks = tables.shape
    block_size, kvh, d = kv_cache.shape[2:]
    first = torch.zeros_like(lens)  # per sequence: the first block gathered
    if window is not None:
        width = -(-window // block_size) + 1  # blocks a window can straddle
        if width < max_blocks:  # gather only the blocks inside each sequence's window
            first = (lens - window).clamp(min=0) // block_size
            cols = first.unsqueeze(1) + torch.arange(width, device=q.device)
            # columns past a table's end are clamped to a real entry; the mask hides them
            tables = tables.gather(1, cols.clamp(max=max_blocks - 1))
            max_blocks = width
    keys = kv_cache[0][tables].view(b, max_blocks * block_size, kvh, d).transpose(1, 2)
    values = kv_cache[1][tables].view(b, max_blocks * block_size, kvh, d).transpose(1, 2)
    pos = (first * block_size).unsqueeze(1) + torch.arange(max_blocks * block_size,
                                                           device=q.device)
    visible = pos < lens.unsqueeze(1)
    if window is not None:
        visible &= pos >= (lens - window).unsqueeze(1)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values,
                                       attn_mask=visible[:, None, None, :], scale=scale,
                                       enable_gqa=True)
    return o.squeeze(2)


def _prefill_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                 scale: float, window: int | None) -> torch.Tensor:
    out = torch.empty_like(q)
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        out[rows] = _attend(q[rows], k[rows], v[rows], 0, scale, window)
    return out
