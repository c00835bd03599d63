"""Model presets for the benchmarks: a config.json written to a temporary directory and loaded
with dummy (random, seeded) weights, so no checkpoint is needed (checkpoint.py writes the same
weights to disk for peers that need files). The shapes are the public models' own; the
weights are not."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # A 125M-parameter Llama: the performance issue's workload model.
    "llama-125m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048,
        "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
        "head_dim": 64, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    },
    # Qwen2-0.5B's shapes: q/k/v biases (implied by the architecture), tied embeddings, a
    # 152K vocabulary (its LM head is a third of the FLOPs of a decode step).
    "qwen2-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "head_dim": 64, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "hidden_act": "silu", "use_sliding_window": False,
        "sliding_window": None, "bos_token_id": 151643, "eos_token_id": 151643,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    },
    # Llama-3.2-1B's shapes: llama3 rope scaling, tied embeddings, 128K vocabulary.
    "llama-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
    # Qwen3-30B-A3B's layers (128 experts of 768, top-8 renormalized, q/k norm, 32 heads of
    # 128, 4 KV heads) but 4 of its 48 and a 32K vocabulary, so that the layers, not the LM
    # head, weigh on a decode step and the weights (5 GB in bf16) fit a small machine.
    "qwen3-moe-small": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "hidden_act": "silu", "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # The same with one dense MLP of the 8 active experts' width (8 x 768 = 6144): the
    # active parameters of qwen3-moe-small but for its routers (0.7% of an MLP).
    "qwen3-dense-small": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "hidden_act": "silu", "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}


def preset_dir(name: str, root: str | None = None) -> str:
    """A checkpoint directory (config.json only) for the preset; load it with
    load_format="dummy". Without `root`, a temporary directory removed when the process
    exits (a benchmark used to leave one in /tmp per run)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    if root is None:
        root = tempfile.mkdtemp(prefix=f"fleetllm-{name}-")
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(PRESETS[name], indent=1))
    return str(path)
