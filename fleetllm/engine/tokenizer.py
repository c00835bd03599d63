"""Loading a checkpoint's Hugging Face tokenizer, without paying for its model config.

transformers 5's AutoTokenizer always builds the model's config class to choose the
tokenizer class, even when tokenizer_config.json names it; importing that class (LlamaConfig
and kin) pulls in torch.distributed.tensor and sympy, about 1-2 s of every fresh engine,
server and CLI process. When tokenizer_config.json names `tokenizer_class` and ships no
remote code (`auto_map`), AutoTokenizer's choice reads only the config's `model_type`,
`model_name` and path, so a bare PretrainedConfig carrying those picks the same class (the
test checks the class and the token ids against a plain AutoTokenizer). Anything else takes
the plain path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def light_config(path: str) -> Any | None:
    """A bare config that leads AutoTokenizer to the class it would choose anyway, or None
    where that choice may depend on more than the declared class (then load the real one)."""
    tok_config = _read(Path(path) / "tokenizer_config.json")
    model_config = _read(Path(path) / "config.json")
    if (tok_config is None or model_config is None or "auto_map" in tok_config
            or "auto_map" in model_config or not isinstance(tok_config.get("tokenizer_class"), str)
            or not isinstance(model_config.get("model_type"), str)):
        return None
    from transformers import PretrainedConfig

    config = PretrainedConfig()
    config._name_or_path = str(path)
    config.model_type = model_config["model_type"]
    if "model_name" in model_config:
        config.model_name = model_config["model_name"]
    return config


def load_tokenizer(path: str) -> Any:
    """The checkpoint's HF tokenizer, or None when the directory ships none; a GGUF file's
    from its metadata."""
    from fleetllm.config_gguf import is_gguf
    from fleetllm.quant.gguf_checkpoint import load_gguf_tokenizer

    if is_gguf(path):
        return load_gguf_tokenizer(path)
    if not any((Path(path) / f).exists() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    config = light_config(path)
    extra = {} if config is None else {"config": config}
    return AutoTokenizer.from_pretrained(path, local_files_only=True, **extra)
