"""Quantized checkpoints: GGUF files (read, and written from a Hugging Face directory) and the
block types fleetllm's kernels read (docs/quantization.md)."""
