"""Pooling (task "embed"): one vector per prompt from the final norm's hidden states.

LAST (the last prompt token: e5-mistral, gte-Qwen2, Qwen3-Embedding), MEAN (the prompt's
average) or CLS (the first token), then optionally truncated (Matryoshka `dimensions`) and
L2-normalized. Which of them a model uses is its PoolerConfig (fleetllm/config_pooler.py).
"""

from __future__ import annotations

import torch

# Their old import path (they live beside fleetllm.config now).
from fleetllm.config_pooler import (  # noqa: F401
    POOLING_TYPES,
    PoolerConfig,
    checkpoint_pooler,
    is_sentence_transformers,
)


def pool(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """One prompt's [tokens, hidden] states -> [hidden], in float32."""
    if pooling_type == "LAST":
        return hidden[-1].float()
    if pooling_type == "CLS":
        return hidden[0].float()
    return hidden.float().mean(dim=0)


def finish(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Matryoshka truncation, then L2 normalization (the order sentence-transformers and
    vLLM use, so a truncated vector is unit length again)."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
    return vector.contiguous()
