from fleetllm.attention.backend import (
    AttentionMetadata,
    DecodeBatch,
    PrefillSpan,
    TorchAttentionBackend,
)

__all__ = ["AttentionMetadata", "DecodeBatch", "PrefillSpan", "TorchAttentionBackend"]
