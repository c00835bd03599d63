"""Tiny random-weight MoE checkpoints written by transformers' own classes (no downloads)."""

from __future__ import annotations

from pathlib import Path

# name -> (architecture, config overrides): each covers one routing feature
MOE_CONFIGS = {
    # softmax top-2 of 8, no renormalization; layer 1 dense (mlp_only_layers); q/k norm
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=8, norm_topk_prob=False,
                                              mlp_only_layers=[1], num_hidden_layers=3)),
    # renormalized top-2; decoder_sparse_step=2: only layer 1 of 0..2 sparse
    "qwen3_moe_norm": ("Qwen3MoeForCausalLM", dict(num_experts=8, norm_topk_prob=True,
                                                   decoder_sparse_step=2,
                                                   num_hidden_layers=3)),
    # a shared expert behind its sigmoid gate; q/k/v bias
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(num_experts=8, norm_topk_prob=False,
                                              shared_expert_intermediate_size=96)),
    # top-2 of 8, renormalized over the selected logits
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=8)),
}


def make_moe_checkpoint(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny MoE checkpoint (config.json, model.safetensors, a tokenizer) at path: the
    dense checkpoints' sizes (conftest.make_checkpoint), top-2 routing, experts of width 32."""
    from conftest import make_checkpoint

    moe = dict(num_experts_per_tok=2)
    if arch != "MixtralForCausalLM":
        moe["moe_intermediate_size"] = 32
    return make_checkpoint(path, arch, seed, **{**moe, **overrides})
