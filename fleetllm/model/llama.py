"""The Llama family: Llama 2/3, Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (q/k norm).

Tensor parallel: q/k/v and gate/up are merged column-parallel projections, o_proj and
down_proj row-parallel. Pipeline parallel: this rank builds only its stage's layers; the
first stage embeds, the last normalizes and owns the LM head.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fleetllm.attention import AttentionMetadata, TorchAttentionBackend
from fleetllm.config import ArchConfig
from fleetllm.distributed.parallel_state import get_pp_group, get_tp_group
from fleetllm.errors import ModelLoadError
from fleetllm.kernels import cpu_kernels
from fleetllm.lora import layers as lora_layers
from fleetllm.model import fused
from fleetllm.model.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
    rotate,
)

# HF checkpoint name -> (our merged parameter, part index)
_MERGED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """Contiguous [start, end) layers of a pipeline stage; earlier stages take the remainder."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding):
        super().__init__()
        tp = get_tp_group()
        d = self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_heads // tp.world_size
        if cfg.num_kv_heads >= tp.world_size:
            self.num_kv_heads = cfg.num_kv_heads // tp.world_size
            kv_start = tp.rank_in_group * self.num_kv_heads
        else:  # fewer KV heads than ranks: each rank keeps (a replica of) the one it needs
            self.num_kv_heads = 1
            kv_start = tp.rank_in_group * cfg.num_kv_heads // tp.world_size
        q_full, kv_full = cfg.num_heads * d, cfg.num_kv_heads * d
        q_shard, kv_shard = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [(q_full, q_shard, tp.rank_in_group * q_shard), (kv_full, kv_shard, kv_start * d),
             (kv_full, kv_shard, kv_start * d)], bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(q_full, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary  # one cos/sin table shared by every layer
        self.scale = d ** -0.5
        self.q_size, self.kv_size = q_shard, kv_shard
        self.sliding_window = cfg.sliding_window  # every layer, as Mistral

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """rope: this step's (cos, sin) tables, looked up once for all layers."""
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(t, kvh, d)
        if self.q_norm is None and cpu_kernels.usable(qkv) and (kv_cache is None
                                                                or kv_cache.is_contiguous()):
            # One C pass: rotate q and k, write k and v into the cache.
            q, k = cpu_kernels.rope_qk_kv(qkv, *rope, h, kvh, kv_cache, meta.slot_mapping)
            o = TorchAttentionBackend.forward(q, k, v, kv_cache, meta, self.scale,
                                              self.sliding_window, kv_written=True)
            return self.o_proj(o.view(t, self.q_size))
        if self.q_norm is None:  # q and k rotated together: one set of kernels, not two
            qk = rotate(qkv[:, :self.q_size + self.kv_size].view(t, h + kvh, d), *rope)
            q, k = qk[:, :h], qk[:, h:]
        else:
            q = rotate(self.q_norm(qkv[:, :self.q_size].view(t, h, d)), *rope)
            k = rotate(self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size]
                                   .view(t, kvh, d)), *rope)
        o = TorchAttentionBackend.forward(q, k, v, kv_cache, meta, self.scale,
                                          self.sliding_window)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.split_evenly(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size,
                                           bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.is_contiguous() and cpu_kernels.usable(gate_up):
            return self.down_proj(cpu_kernels.silu_mul(gate_up))  # one pass, no temporaries
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = Attention(cfg, rotary)
        self.mlp = MLP(cfg) if mlp is None else mlp  # another: a mixture of experts (moe.py)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope, hidden, residual, kv_cache, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """lm_head=False builds the pooling model (task "embed"): the same stack, no LM head; a
    checkpoint's lm_head tensor, if any, is skipped."""

    def __init__(self, cfg: ArchConfig, max_position: int, lm_head: bool = True):
        super().__init__()
        pp = get_pp_group()
        self.cfg = cfg
        self.is_first_stage, self.is_last_stage = pp.is_first, pp.is_last
        self.start_layer, self.end_layer = stage_layers(cfg.num_layers, pp.world_size,
                                                        pp.rank_in_group)
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
                             if self.is_first_stage or (cfg.tie_word_embeddings and lm_head)
                             else None)
        rotary = self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta,
                                               cfg.rope_scaling)
        # Keyed by the global layer index so checkpoint names map directly.
        self.layers = nn.ModuleDict({str(i): self.make_layer(cfg, rotary, i)
                                     for i in range(self.start_layer, self.end_layer)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last_stage else None
        self.lm_head = None
        if self.is_last_stage and lm_head:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight

    def make_layer(self, cfg: ArchConfig, rotary: RotaryEmbedding, index: int) -> nn.Module:
        """Decoder layer `index` (a subclass may build another kind: model/moe.py)."""
        return DecoderLayer(cfg, rotary)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor] | None, meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (hidden, residual): final normed hidden states on the last stage, else the
        (hidden, residual) pair to send to the next stage."""
        if self.is_first_stage:
            x, residual = input_ids, None  # embedded in the fused call, or below
            dtype = self.norm_dtype
        else:
            x, residual = intermediate
            dtype = x.dtype
        # The fused layers have no LoRA deltas: a step with adapter rows runs module by module.
        # They embed the tokens, look up RoPE's rows and apply the final norm in the same call.
        if kv_caches is not None and not lora_layers.active():
            done = fused.run_layers(self, positions, x, residual, kv_caches, meta)
            if done is not None:
                return done if not self.is_last_stage else (done[0], None)
        rope = self.rotary.cos_sin(positions, dtype)
        hidden = self.embed_tokens(x) if self.is_first_stage else x
        for i, layer in enumerate(self.layers.values()):
            hidden, residual = layer(rope, hidden, residual,
                                     None if kv_caches is None else kv_caches[i], meta)
        if not self.is_last_stage:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden, None

    @property
    def norm_dtype(self) -> torch.dtype:
        """The model's dtype: its norms' (a GGUF model's embedding may be quantized)."""
        layer = next(iter(self.layers.values()), None)
        return (layer.input_layernorm if layer is not None else self.norm).weight.dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    def load_weights(self, tensors: Iterable[tuple[str, Any]], where: Any) -> set[str]:
        """Load each (checkpoint name, tensor); returns the parameters filled. A tensor with
        no place in the model, or of the wrong shape: ModelLoadError naming it and `where`."""
        loaded = set()
        for name, tensor in tensors:
            try:
                filled = self.load_weight(name, tensor)
            except (KeyError, ValueError, RuntimeError) as e:
                raise ModelLoadError(f"{where}: tensor {name!r}: {e}") from e
            if filled:
                loaded.add(filled)
        return loaded

    def load_weight(self, name: str, loaded: Any) -> str | None:
        """Load one checkpoint tensor; returns the parameter name it filled (None: not ours)."""
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name:
            return None
        if name.startswith("lm_head.") and (self.cfg.tie_word_embeddings
                                            or self.lm_head is None):
            return None
        if name.startswith("layers."):
            index = int(name.split(".")[1])
            if not self.start_layer <= index < self.end_layer:
                return None
        elif name.startswith("embed_tokens.") and self.embed_tokens is None:
            return None
        elif name.startswith(("norm.", "lm_head.")) and not self.is_last_stage:
            return None
        part = None
        for hf_name, (ours, index) in _MERGED.items():
            if f".{hf_name}." in name:
                name, part = name.replace(hf_name, ours), index
                break
        if not hasattr(self, "_param_index"):
            self._param_index = dict(self.named_parameters())
        params = self._param_index
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
        param = params[name]
        getattr(param, "weight_loader", default_weight_loader)(param, loaded, part)
        return name
