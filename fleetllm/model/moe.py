"""Mixture-of-experts models: Qwen3-MoE, Qwen2-MoE (a shared expert) and Mixtral.

What: `MoeForCausalLM` is the Llama family's model (llama.py: attention, norms, pipeline
stages, tensor parallelism) whose MoE layers (ArchConfig.moe_layers) replace the MLP with a
`SparseMoeBlock`; the other layers (Qwen's mlp_only_layers, decoder_sparse_step) keep the
dense MLP.
How: the router (replicated on every rank) gives float32 logits' softmax, its top k
(renormalized where norm_topk_prob, always for Mixtral), as transformers computes them;
the experts (moe_experts.FusedExperts: stacked weights, the C++ op or PyTorch) give this
rank's partial sum, all-reduced like a row-parallel projection. Qwen2-MoE adds its shared
expert, a dense MLP scaled by sigmoid(shared_expert_gate(x)), split over the ranks like the
dense MLP with or without expert parallelism. Each block counts the (token, expert) pairs
its router picks (`expert_tokens`, a bincount a step: model/moe_load.py reads them).
Checkpoint tensors are named as on the Hub (mlp.experts.E.{gate,up,down}_proj; Mixtral's
block_sparse_moe.experts.E.w1/w3/w2) and stacked as they load; under expert parallelism a
rank's loader skips the other ranks' experts (moe_experts.FusedExperts.load_expert).
What fails: unsupported routers are refused by config_model._moe_fields (ModelLoadError,
before any worker starts); a missing expert tensor leaves its stacked weight unfilled, which
the loader reports as a missing tensor.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

from fleetllm.config import ArchConfig
from fleetllm.distributed.parallel_state import get_tp_group
from fleetllm.model.layers import ColumnParallelLinear, RotaryEmbedding
from fleetllm.model.llama import MLP, DecoderLayer, LlamaForCausalLM
from fleetllm.model.moe_experts import DOWN, GATE, UP, FusedExperts

# layers.N.(mlp|block_sparse_moe).experts.E.<name>.weight, "model." already removed
_EXPERT_TENSOR = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                            r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_PART = {"gate_proj": GATE, "w1": GATE, "up_proj": UP, "w3": UP, "down_proj": DOWN, "w2": DOWN}


def replicated_linear(input_size: int, output_size: int) -> ColumnParallelLinear:
    """A projection every tensor-parallel rank holds whole (the router, the shared gate)."""
    return ColumnParallelLinear(input_size, [(output_size, output_size, 0)], bias=False)


class SharedExpert(MLP):
    """Qwen2-MoE's always-on expert: a dense MLP of its own intermediate size."""

    def __init__(self, cfg: ArchConfig):
        super().__init__(dataclasses.replace(
            cfg, intermediate_size=cfg.shared_expert_intermediate_size))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        # pairs routed to each expert since moe_load last took them: the same on every TP
        # rank (the router is replicated); a plain tensor, not a buffer (no checkpoint entry)
        self.expert_tokens = torch.zeros(cfg.num_experts, dtype=torch.int64)
        self.top_k = cfg.experts_per_token
        self.renormalize = cfg.norm_topk_prob
        # Qwen casts the routing weights to the model's dtype before they scale the experts'
        # outputs; Mixtral keeps them in float32.
        self.round_weights = cfg.architecture != "MixtralForCausalLM"
        self.gate = replicated_linear(cfg.hidden_size, cfg.num_experts)
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size,
                                    cfg.moe_intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(cfg)
            self.shared_expert_gate = replicated_linear(cfg.hidden_size, 1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], float32 weights [T, k]) for x [T, H], as transformers routes."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_weights:
            weights = weights.to(x.dtype).float()
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        self.expert_tokens += torch.bincount(ids.reshape(-1),
                                             minlength=self.expert_tokens.numel())
        out = get_tp_group().all_reduce(self.experts(x, ids, weights))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeForCausalLM(LlamaForCausalLM):
    def make_layer(self, cfg: ArchConfig, rotary: RotaryEmbedding, index: int) -> nn.Module:
        return DecoderLayer(cfg, rotary, SparseMoeBlock(cfg, index) if index in cfg.moe_layers
                            else None)

    def load_weight(self, name: str, loaded: Any) -> str | None:
        """Expert tensors go into their layer's stacked weights (the parameter's name is
        returned once every expert's part is in); Mixtral's block_sparse_moe is our mlp; the
        rest as the dense models load."""
        name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        match = _EXPERT_TENSOR.fullmatch(name)
        if match is None:
            return super().load_weight(name, loaded)
        index = int(match[1])
        if not self.start_layer <= index < self.end_layer:
            return None
        experts = self.layers[str(index)].mlp.experts
        part = _PART[match[3]]
        if experts.load_expert(int(match[2]), part, loaded):
            return f"layers.{index}.mlp.experts.{'w2' if part == DOWN else 'w13'}"
        return None
