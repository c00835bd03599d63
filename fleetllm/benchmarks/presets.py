"""Model presets for the benchmarks: a config.json written to a temporary directory and loaded
with dummy (random, seeded) weights, so no checkpoint is needed."""

from __future__ import annotations

import json
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
}


def preset_dir(name: str, root: str | None = None) -> str:
    """A checkpoint directory (config.json only) for the preset; load it with
    load_format="dummy"."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    path = Path(root or tempfile.mkdtemp(prefix=f"fleetllm-{name}-"))
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(PRESETS[name], indent=1))
    return str(path)
