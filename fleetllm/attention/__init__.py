from fleetllm.attention.backend import AttentionMetadata, PrefillSpan, TorchAttentionBackend

__all__ = ["AttentionMetadata", "PrefillSpan", "TorchAttentionBackend"]
