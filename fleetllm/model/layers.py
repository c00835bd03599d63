"""Building blocks split across tensor-parallel ranks: projections, norm, embedding, RoPE.

Each layer holds its rank's shard; `weight_loader(param, loaded, part=None)` copies that slice
from the checkpoint tensor or a lazy safetensors slice, so a rank reads only its own bytes.
A projection computes through `self.kernel` (linear_kernels.py): F.linear until the loader's
kernel_choice.select_kernels gives it the kernel chosen for this machine.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fleetllm.distributed.parallel_state import get_tp_group
from fleetllm.kernels import cpu_kernels
from fleetllm.lora.layers import lora_delta
from fleetllm.model.linear_kernels import LinearKernel, TorchLinear
from fleetllm.quant.groups import GroupQuant
from fleetllm.quant.packed import QuantTensor, dequantize_packed

# A quantized checkpoint's tensor: kept as blocks, never copied into a dense weight
Quantized = QuantTensor | GroupQuant


def narrow(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start+length) of a tensor, safetensors slice or
    quantized tensor (a GGUF QuantTensor, a GroupQuant)."""
    if isinstance(loaded, torch.Tensor | Quantized):
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


def stash(module: nn.Module, part: int, tensor: QuantTensor | GroupQuant,
          shape: tuple[int, int]) -> None:
    """Keep a quantized tensor's blocks (a GroupQuant's, made now: this rank's shard, of
    `shape`) for `part` of module's weight, until the loader packs them
    (quant/gguf_loader.finish)."""
    if tuple(tensor.shape) != shape:
        raise ValueError(f"this rank's shard has shape {tuple(tensor.shape)}, the model's is "
                         f"{shape}")
    if isinstance(tensor, GroupQuant):
        tensor = tensor.blocks()
    module.__dict__.setdefault("quant_parts", {})[part] = tensor


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
        self.kernel: LinearKernel = TorchLinear(self)

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
        if isinstance(loaded, Quantized):  # kept as blocks (quant/gguf_loader.py)
            stash(self, part, loaded.narrow(0, start, shard), (shard, self.input_size))
            return
        rows = load_full(narrow(loaded, 0, start, shard))
        param.data.narrow(0, self.part_offsets[part], shard).copy_(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lora_delta(self, x, self.kernel(x, self.bias))  # LoRA: fleetllm/lora/layers.py


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
        self.kernel: LinearKernel = TorchLinear(self)

    def weight_loader(self, param: nn.Parameter, loaded: Any, part: int | None = None) -> None:
        if isinstance(loaded, Quantized) and param is self.weight:
            stash(self, 0, loaded.narrow(1, self.start, self.shard),
                  (self.output_size, self.shard))
            return
        param.data.copy_(load_full(narrow(loaded, 1, self.start, self.shard)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A LoRA delta joins this rank's partial sum: the all-reduce adds the ranks' parts.
        y = get_tp_group().all_reduce(lora_delta(self, x, self.kernel(x)))
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
        # Not zeros: a GGUF model never writes a quantized embedding's weight (its memory is
        # never touched); the padding rows are zero.
        self.weight = nn.Parameter(torch.empty(self.shard, hidden_size))
        self.weight.data[self.valid:].zero_()
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, part: int | None = None) -> None:
        if isinstance(loaded, Quantized):
            stash(self, 0, loaded.narrow(0, self.start, self.valid),
                  (self.valid, self.weight.shape[1]))
            return
        if self.valid:
            param.data[: self.valid].copy_(load_full(narrow(loaded, 0, self.start, self.valid)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tp = get_tp_group()
        if tp.world_size == 1:
            return self.rows(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.valid)
        out = self.rows(local.clamp(0, self.shard - 1)) * inside.unsqueeze(-1)
        return tp.all_reduce(out)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """This shard's rows at ids: the weight's, or a quantized copy's (GGUF: `packed`, the
        rows dequantized as looked up)."""
        packed = getattr(self, "packed", None)
        if packed is None:
            return F.embedding(ids, self.weight)
        flat = ids.reshape(-1).to(torch.long).contiguous()
        if cpu_kernels.available() and flat.device.type == "cpu":
            out = cpu_kernels.gguf_rows(packed, flat, self.packed_dtype)
        else:  # the PyTorch path: the whole table dequantized for the call, then dropped
            out = dequantize_packed(packed)[flat.cpu()].to(ids.device, self.packed_dtype)
        return out.view(*ids.shape, out.shape[-1])


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.kernel: LinearKernel = TorchLinear(self)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits on every TP rank (gathered)."""
        # The rows are the sequences sampled in a step (a prompt's tokens with prompt logprobs)
        local = self.kernel(hidden)
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
        elif kind == "freq_factors":  # a GGUF file's rope_freqs: llama3's, as llama.cpp has it
            inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
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
