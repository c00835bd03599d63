"""Tiny random-weight MoE checkpoints written by transformers' own classes (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

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
    """Save a tiny MoE checkpoint (config.json, model.safetensors, a tokenizer) at path."""
    import transformers
    from conftest import make_tokenizer

    cfg_cls = {"Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
               "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
               "MixtralForCausalLM": transformers.MixtralConfig}[arch]
    kwargs = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                  head_dim=16, num_experts_per_tok=2)
    if arch != "MixtralForCausalLM":
        kwargs["moe_intermediate_size"] = 32
    kwargs.update(overrides)
    config = cfg_cls(**kwargs)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config)
    with torch.no_grad():  # random init is tiny; widen it so logits are not all near-equal
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(path, kwargs["vocab_size"])
    return path
