"""Building blocks split across tensor-parallel ranks, and how each projection is computed.

Each layer holds its rank's shard; `weight_loader(param, loaded, part=None)` copies that slice
from the checkpoint tensor or a lazy safetensors slice, so a rank reads only its own bytes.
After loading, `pack_linear_weights` (`_packing_plan`) picks each projection's copies on CPU:
oneDNN's packed layout (MKL's packed sgemm for float32 on Intel: mkl_packed.py); the dense
weight for fleetllm's GEMV on small batches (decode_gemv_rows) while the projections weigh at
most FLEETLLM_GEMV_MAX_BYTES; bf16 packed by pairs (pair_packed.py) or for AMX tiles
(amx_packed.py) where the CPU has the instructions; a float32 copy for bf16 where oneDNN packs
no bf16 (AVX2). `linear` then runs the copy for the call's row count. FLEETLLM_LINEAR=packed
or =dense forces one kind; FLEETLLM_BATCH_INVARIANT=1 keeps the kernels' copy alone, so a row's
bits do not depend on its batch. Measured reasons: docs/performance.md.
"""

from __future__ import annotations

import logging
import math
import os
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fleetllm import envs
from fleetllm.distributed.parallel_state import get_tp_group
from fleetllm.kernels import cpu_kernels
from fleetllm.lora.layers import lora_delta
from fleetllm.model import amx_packed, huge_pages, mkl_packed, pair_packed
from fleetllm.model.amx_packed import AmxPacked
from fleetllm.model.mkl_packed import MklPacked

logger = logging.getLogger(__name__)


def narrow(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start+length) of a tensor or safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = (slice(start, start + length),) if dim == 0 else (slice(None), slice(start,
                                                                                start + length))
    return loaded[index]


def load_full(loaded: Any) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def default_weight_loader(param: nn.Parameter, loaded: Any, part: int | None = None) -> None:
    tensor = load_full(loaded)
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"shape {tuple(tensor.shape)} does not match the model's "
                         f"{tuple(param.shape)}")
    param.data.copy_(tensor)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Norm of x, or with a residual: (norm(x + residual), x + residual); the returned
        residual may be the given one, updated in place."""
        if x.dim() == 2 and x.is_contiguous() and cpu_kernels.usable(x, self.weight) and (
                residual is None or residual.is_contiguous()):
            out = cpu_kernels.add_rmsnorm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:  # one fused kernel instead of six passes (as HF's math)
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        else:  # HF normalizes in float32 and casts back before the weight
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split across TP ranks. Several logical projections may be
    merged into one matmul (q/k/v, gate/up): `parts` gives each part's (full size, shard size,
    shard offset in the full tensor) for this rank."""

    def __init__(self, input_size: int, parts: list[tuple[int, int, int]], bias: bool):
        super().__init__()
        self.parts = parts
        self.input_size = input_size
        self.part_offsets = [sum(p[1] for p in parts[:i]) for i in range(len(parts))]
        out = sum(p[1] for p in parts)
        self.weight = nn.Parameter(torch.empty(out, input_size))
        self.weight.weight_loader = self.weight_loader
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    @classmethod
    def split_evenly(cls, input_size: int, output_sizes: list[int], bias: bool
                     ) -> ColumnParallelLinear:
        tp = get_tp_group()
        parts = []
        for size in output_sizes:
            shard = size // tp.world_size
            parts.append((size, shard, tp.rank_in_group * shard))
        return cls(input_size, parts, bias)

    def weight_loader(self, param: nn.Parameter, loaded: Any, part: int | None = None) -> None:
        part = part or 0
        full, shard, start = self.parts[part]
        rows = load_full(narrow(loaded, 0, start, shard))
        param.data.narrow(0, self.part_offsets[part], shard).copy_(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lora_delta(self, x, linear(self, x, self.bias))  # LoRA: fleetllm/lora/layers.py


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across TP ranks; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool):
        super().__init__()
        tp = get_tp_group()
        self.shard = input_size // tp.world_size
        self.start = tp.rank_in_group * self.shard
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, self.shard))
        self.weight.weight_loader = self.weight_loader
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Any, part: int | None = None) -> None:
        param.data.copy_(load_full(narrow(loaded, 1, self.start, self.shard)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A LoRA delta joins this rank's partial sum: the all-reduce adds the ranks' parts.
        y = get_tp_group().all_reduce(lora_delta(self, x, linear(self, x)))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across TP ranks (the last shard zero-padded); the LM head shares the
    layout, so tied embeddings share the parameter."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        tp = get_tp_group()
        self.vocab_size = vocab_size
        self.shard = math.ceil(vocab_size / tp.world_size)
        self.start = tp.rank_in_group * self.shard
        self.valid = max(0, min(self.shard, vocab_size - self.start))
        self.weight = nn.Parameter(torch.zeros(self.shard, hidden_size))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, part: int | None = None) -> None:
        if self.valid:
            param.data[: self.valid].copy_(load_full(narrow(loaded, 0, self.start, self.valid)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tp = get_tp_group()
        if tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.valid)
        out = F.embedding(local.clamp(0, self.shard - 1), self.weight) * inside.unsqueeze(-1)
        return tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits on every TP rank (gathered)."""
        # The rows are the sequences sampled in a step (a prompt's tokens with prompt logprobs)
        local = linear(self, hidden, gemv_rows=decode_gemv_rows(self))
        full = get_tp_group().all_gather(local, dim=-1)
        # Slice off the shards' padding only where there is some: the slice costs a batch-1
        # step measurably (it runs from a cold cache after the weight stream).
        return full if full.shape[-1] == self.vocab_size else full[..., : self.vocab_size]


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves), as HF Llama/Qwen. Supports linear and llama3 scaling."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None):
        super().__init__()
        # float32 whatever the model's dtype (as HF computes them); cast when applied
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                                    .to(torch.float32) / head_dim))
        kind = (scaling or {}).get("rope_type", "default")
        if kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind != "default":
            from fleetllm.errors import ConfigurationError
            raise ConfigurationError(f"rope_scaling: type {kind!r} is not supported (default, "
                                     "linear, llama3 are)")
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self._cast: tuple | None = None  # (dtype, cos, sin): the tables in a dtype

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's tables ([T, 1, d/2] each), looked up once and shared by every layer:
        rows of the tables cast to `dtype` once (the same values as casting the rows; two
        ops a step instead of six)."""
        cos, sin = self.tables(dtype)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole (cos, sin) tables ([max_position, 1, d/2]) in `dtype`, cast once."""
        cast = self._cast
        if cast is None or cast[0] != dtype:  # (a move drops it: _apply)
            cast = self._cast = (dtype, self.cos.unsqueeze(1).to(dtype),
                                 self.sin.unsqueeze(1).to(dtype))
        return cast[1], cast[2]

    def _apply(self, fn, *args, **kwargs):
        self._cast = None  # moved (to, cpu, cuda: sleep level 1): not kept where it was
        return super()._apply(fn, *args, **kwargs)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, heads, d], k: [T, kv_heads, d] -> rotated copies."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return rotate(q, cos, sin), rotate(k, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox RoPE of x [T, heads, d] (any row stride) into a new contiguous tensor: four
    kernels writing the halves in place, no temporaries or concatenation."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1)
    torch.mul(x2, cos, out=o2)
    if x.dtype == torch.float32:
        o1.addcmul_(x2, sin, value=-1.0)
        o2.addcmul_(x1, sin)
    else:  # each product rounded to x's dtype before the sum, as transformers computes it
        o1.sub_(x2 * sin)
        o2.add_(x1 * sin)
    return out


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


# ---------------------------------------------------------------- packed projection weights

# Up to this many rows, the GEMV kernel on the dense weight. Decode steps of up to 8 tokens
# run it through the one-call decoder layer (fused.py); here it stays at 4: at 8, a 5-8 token
# prompt alone in its step took the kernel and in a shared step oneDNN, so two requests for the
# same embedding differed in the last bits (tests/test_server_embeddings.py caught it).
GEMV_ROWS = 4


def decode_gemv_rows(layer: nn.Module) -> int:
    """Up to how many rows a decode step's projections (the fused layers, fused.py) and the LM
    head take the GEMV kernel: where it beats oneDNN's packed copy. A bf16 weight whose packed
    copy is float32 (a CPU without bf16 packing) reads half the bytes through the kernel. On a
    2-core AVX2 EPYC, the 125M preset's weights (`tools/cpu_gemv_bench.py --setting model
    --rows 8 12 16 24 --onednn`), kernel vs oneDNN: bf16 8 rows 33.2 vs 52.3 ms, 12 rows
    42.7 vs 54.9, 16 rows 53.7 vs 62.3, 24 rows 71.9 vs 79.6; float32 8 rows 43.0 vs 53.9, 12
    rows 75.9 vs 55.2. With AVX-512 (2-core Zen 4, the same command), float32 weights from
    memory keep 8 rows too since the kernel prefetches its 4 weight rows into L2 (kernel vs
    oneDNN: 5 rows 12.9-14.0 vs 14.7-17.4 ms, 6 rows 12.9-15.0 vs 14.2-17.6, 8 rows 15.3-18.4
    vs 17.1-22.8; without the prefetch oneDNN won from 5 rows and such weights stopped at 4).
    bf16 weights that oneDNN packs in bf16 (AVX-512) keep 8 as well, large ones too, since
    the kernel's bf16 tile reads several weight rows at once from 3 rows of x (`--setting
    qwen2-0.5b llama-1b --rows 4 6 8 10 --onednn`, weights from memory, kernel vs oneDNN, ms:
    Qwen2-0.5B's shapes 17.2 / 16.9 / 18.5 / 21.5 vs 19.4 / 19.6 / 23.6 / 25.3, Llama-3.2-1B's
    31.7 / 32.8 / 40.7 / 44.5 vs 32.6 / 32.6 / 39.5 / 41.8; before it, large bf16 layers
    stopped at 3 rows). A sequence's logits are then the same bits in any
    decode batch up to this size (the kernel's rows are independent), given the same hidden
    states; fused.py applies the same rules to whole layers."""
    packed, weight = getattr(layer, "packed_weight", None), layer.weight
    if isinstance(packed, pair_packed.PairPacked) or small_batch_weight(layer) is not None:
        return 0  # its GEMM streams the weight faster than the GEMV at every number of rows
    if weight is None:
        return 0  # no dense weight for the GEMV to read: the packed copy takes every row
    if packed is not None and packed.dtype != weight.dtype:
        return 16
    return 8


def small_batch_weight(layer: nn.Module) -> pair_packed.PairPacked | AmxPacked | None:
    """The copy that batches of up to small_batch_rows(layer) rows read beside oneDNN's packed
    copy (CPUs where oneDNN runs on AMX): packed for the kernels' AMX GEMM, or by pairs where
    the weight's sizes do not suit the tiles; or None."""
    return getattr(layer, "pairs_weight", None)


def small_batch_rows(layer: nn.Module) -> int:
    """Up to how many rows a batch reads small_batch_weight(layer) (0 without one)."""
    small = small_batch_weight(layer)
    if small is None:
        return 0
    return amx_packed.MAX_ROWS if isinstance(small, AmxPacked) else pair_packed.SMALL_ROWS


def linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None,
           gemv_rows: int = GEMV_ROWS) -> torch.Tensor:
    """x @ layer.weight^T (+ bias): a weight packed by pairs takes the kernels' GEMM at any
    number of rows (pair_packed.py); beside oneDNN's copy, the small batches' copy
    (small_batch_weight: on AMX tiles or by pairs) up to its row limit; else the GEMV kernel
    for up to `gemv_rows` rows when the dense weight is kept, else the packed weight when the
    layer has one (oneDNN's, or MKL's for float32 on Intel CPUs: mkl_packed.py), else
    F.linear."""
    packed, weight = getattr(layer, "packed_weight", None), layer.weight
    small = small_batch_weight(layer)
    if small is not None and x.numel() <= small_batch_rows(layer) * x.shape[-1]:
        packed = small
    if isinstance(packed, AmxPacked):
        shape = x.shape
        y = amx_packed.matmul(x.reshape(-1, shape[-1]), packed, bias)
        return y.view(*shape[:-1], y.shape[-1])
    pairs = isinstance(packed, pair_packed.PairPacked)
    if not pairs and weight is not None and x.dim() == 2 and x.shape[0] <= gemv_rows and \
            x.is_contiguous() and cpu_kernels.usable(x, weight):
        return cpu_kernels.gemv(x, weight, bias)
    if packed is None:
        return F.linear(x, weight, bias)
    shape = x.shape
    if x.dim() != 2:
        x = x.reshape(-1, shape[-1])
    if pairs:
        y = pair_packed.matmul(x, packed, bias)
    elif isinstance(packed, MklPacked):
        y = mkl_packed.matmul(x, packed, bias)
    elif packed.dtype != x.dtype:  # a float32 copy of a bf16 weight (see the module docstring)
        y = torch.ops.mkldnn._linear_pointwise(x.float().contiguous(), packed,
                                               None if bias is None else bias.float(), "none",
                                               [None], "").to(x.dtype)
    else:
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [None], "")
    return y if len(shape) == 2 else y.view(*shape[:-1], y.shape[-1])


def _can_pack(weight: torch.Tensor) -> bool:
    if envs.get("FLEETLLM_LINEAR") == "dense":
        return False
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_linear_pointwise")


def pack_linear_weights(model: nn.Module) -> int:
    """Give each projection (and the LM head) a oneDNN-packed copy of its weight, checked
    against F.linear on a few rows. The dense weight stays for the small-batch GEMV kernel
    while all of them weigh at most FLEETLLM_GEMV_MAX_BYTES and none is packed by pairs (that
    copy serves every number of rows), else it is freed (unless the embedding shares it).
    Returns the number of layers packed; 0 leaves the model unchanged."""
    linears, shared, packable, keep_dense, by_pairs = _packing_plan(model)
    if not packable:
        return 0  # CUDA weights (or FLEETLLM_LINEAR=dense): don't build the CPU kernels below
    # The copies packed by pairs are what decode steps stream: one huge-page arena for all of
    # them (model/huge_pages.py: fewer TLB misses on the stream).
    pairs = [m.weight for m in linears if m.weight is not None and _can_pack(m.weight)
             and pair_packed.applies(m.weight)] if by_pairs else []
    # With AMX, oneDNN's copy serves all but small batches; the pairs' copy beside it costs
    # the projections' size again, kept within _pairs_budget().
    # FLEETLLM_BATCH_INVARIANT: the kernels' copy alone (on AMX tiles where it applies).
    invariant = pair_packed.batch_invariant()
    amx = bool(pairs) and pair_packed.onednn_amx() and not invariant
    if amx and sum(map(pair_packed.nbytes, pairs)) > _pairs_budget():
        pairs = []  # oneDNN's alone: 16-30% slower at one row, the same from two
    arena = huge_pages.empty(sum(map(pair_packed.nbytes, pairs))) if pairs else None
    by_pairs = {id(w) for w in pairs}
    offset = count = 0
    for module in linears:
        weight = module.weight
        if weight is None or not _can_pack(weight):
            continue
        small = None
        try:
            if id(weight) in by_pairs:
                size = pair_packed.nbytes(weight)
                if (amx or invariant) and amx_packed.applies(weight):
                    small = amx_packed.pack(weight.detach(), arena[offset:offset + size])
                else:
                    small = pair_packed.pack(weight.detach(), arena[offset:offset + size])
                offset += size
            if small is not None and not amx:
                packed = small
            elif keep_dense and mkl_packed.applies(weight):  # MKL's has no way back to dense
                packed = mkl_packed.pack(weight.detach())
            else:
                packed = _pack(weight.detach())
            probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
            probe = probe.to(weight.dtype)
            tol = 1e-4 if weight.dtype == torch.float32 else 2e-2  # bf16: output rounding
            for copy in [packed] if small is None or small is packed else [packed, small]:
                got = linear(SimpleNamespace(weight=None, packed_weight=copy), probe).float()
                want = F.linear(probe, weight).float()
                # not torch.testing.assert_close: it imports torch.distributed.tensor (~1 s)
                if not torch.allclose(got, want, rtol=tol, atol=tol):
                    err = (got - want).abs().max().item()
                    raise AssertionError(f"packed copy differs from F.linear by {err:.3g}")
        except (RuntimeError, AssertionError) as e:
            logger.warning("oneDNN weight packing unavailable (%s): plain F.linear", e)
            return count
        module.packed_weight = packed
        module.pairs_weight = small if packed is not small else None
        if not keep_dense and id(weight) not in shared:  # the packed copy replaces it
            module.weight = None
            module.dense_dtype = weight.dtype  # what to_dense() gives back (sharded_state)
        count += 1
    return count


def dense_weights_kept(model: nn.Module) -> bool:
    """Whether the projections' dense weights stay after pack_linear_weights (for the GEMV
    kernel or plain F.linear); computable before loading, from the shapes alone."""
    _, _, packable, keep_dense, _ = _packing_plan(model)
    return keep_dense or not packable


def _packing_plan(model: nn.Module) -> tuple[list[nn.Module], set[int], bool, bool, bool]:
    """The projections (and LM head), the ids of weights the embedding shares, whether any of
    them can be packed, whether packing keeps the dense weights beside the packed copies, and
    whether the bf16 ones are packed by pairs."""
    shared = {id(m.weight) for m in model.modules() if isinstance(m, VocabParallelEmbedding)
              and not isinstance(m, ParallelLMHead)}
    linears = [m for m in model.modules()
               if isinstance(m, ColumnParallelLinear | RowParallelLinear | ParallelLMHead)]
    # What keeping the dense weights costs: a tied LM head's is the embedding's, kept anyway.
    dense_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears
                      if m.weight is not None and id(m.weight) not in shared)
    dense_ok = envs.get("FLEETLLM_LINEAR") == "auto" and cpu_kernels.available() \
        and dense_bytes <= _dense_budget()
    # Weights packed by pairs read only that copy at any number of rows: no dense copy then.
    # Where oneDNN packs no bf16 (AVX2), its float32 copy (prompts) and the dense weight for the
    # GEMV (decode steps of up to 16 rows) were the faster pair, so the pairs' copy takes over
    # only where the dense weights would not be kept: there the float32 copy alone read twice
    # the bytes in every decode step, in twice the memory.
    # FLEETLLM_BATCH_INVARIANT: the pairs' copy alone at every size, whatever is faster.
    by_pairs = any(m.weight is not None and pair_packed.applies(m.weight) for m in linears) \
        and (not dense_ok or pair_packed.onednn_packs_bf16() or pair_packed.batch_invariant())
    keep_dense = dense_ok and not by_pairs
    packable = any(m.weight is not None and _can_pack(m.weight) for m in linears)
    return linears, shared, packable, keep_dense, by_pairs


def _dense_budget() -> int:
    """The most bytes of projections that get a second copy for small batches."""
    budget = envs.get("FLEETLLM_GEMV_MAX_BYTES")
    return 2 << 30 if budget is None else budget


def _pairs_budget() -> int:
    """The same for the copies by pairs beside oneDNN's on AMX: FLEETLLM_GEMV_MAX_BYTES if
    set, else a quarter of the machine's memory (at least 2 GiB): without them small batches
    run oneDNN's AMX matmul, slower at a few rows."""
    if envs.get("FLEETLLM_GEMV_MAX_BYTES") is not None:
        return _dense_budget()
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return max(2 << 30, memory // 4)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of `weight`; of its float32 copy for a bf16 weight on a CPU where
    oneDNN packs no bf16 (see the module docstring). (Weights packed by pairs go through
    pack_linear_weights' arena instead.)"""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except RuntimeError:
        if weight.dtype != torch.bfloat16:
            raise
        return torch.ops.mkldnn._reorder_linear_weight(weight.float(), None)
