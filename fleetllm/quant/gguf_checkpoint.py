"""A GGUF file's tensors for the loader (config_gguf.py reads its metadata): each 2-D weight
as a QuantTensor (the raw blocks, a view of the mapping, whatever its type: F32/F16/BF16 too,
so that a merged projection can mix them; a 3-D MoE expert tensor as one per expert, views of
its blocks), 1-D tensors (norms, biases) as float32 tensors; and
the tokenizer transformers builds from the metadata. Arch "llama" files store q and k with
their rows permuted for llama.cpp's RoPE (convert_hf_to_gguf.py's permute); they are put back,
rows being whole blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fleetllm.config_gguf import GgufFile, is_gguf, open_gguf
from fleetllm.errors import ModelLoadError
from fleetllm.quant.packed import QuantTensor

__all__ = ["GgufFile", "is_gguf", "open_gguf", "tensors", "load_gguf_tokenizer"]


def tensors(gguf: GgufFile) -> Iterator[tuple[str, QuantTensor | torch.Tensor]]:
    """(Hugging Face name, tensor) for each tensor: 2-D ones as QuantTensor, others as
    float32 tensors. Raises ModelLoadError for a tensor that is not one the model has."""
    for info in gguf.reader.tensors:
        if info.name == "rope_freqs.weight":  # in the config (rope_scaling)
            continue
        if len(info.shape) == 3:  # an MoE layer's experts: each one's matrix, a view
            yield from _experts(gguf, info)
            continue
        name = gguf.hf_name(info.name)
        if name is None:
            raise ModelLoadError(f"{gguf.path}: tensor {info.name!r} has no place in a "
                                 f"{gguf.arch} model")
        yield name, _tensor(gguf, info, name)


def _experts(gguf: GgufFile, info: Any) -> Iterator[tuple[str, QuantTensor]]:
    """(expert e's Hugging Face name, its [rows, cols] blocks) of a 3-D expert tensor."""
    experts, rows, cols = (int(d) for d in reversed(info.shape.tolist()))
    try:
        raw = np.asarray(info.data).view(np.uint8).reshape(experts, rows, -1)
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"{gguf.path}: tensor {info.name!r} is unreadable (a "
                             f"truncated file?): {e}") from e
    for e in range(experts):
        name = gguf.hf_name(info.name, e)
        if name is None:
            raise ModelLoadError(f"{gguf.path}: tensor {info.name!r} has no place in a "
                                 f"{gguf.arch} model")
        yield name, QuantTensor(raw[e], info.tensor_type, (rows, cols))


def _tensor(gguf: GgufFile, info: Any, name: str) -> QuantTensor | torch.Tensor:
    shape = tuple(int(d) for d in reversed(info.shape.tolist()))  # ggml: columns first
    try:
        raw = info.data
        if len(shape) == 1:
            t = QuantTensor(np.asarray(raw).view(np.uint8).reshape(1, -1), info.tensor_type,
                            (1, shape[0]))
            if name.endswith("shared_expert_gate.weight"):  # [H] in the file, [1, H] here
                return t.dequantize()
            return t.dequantize().reshape(shape[0])
        if len(shape) != 2:
            raise ModelLoadError(f"{gguf.path}: tensor {info.name!r} has shape {shape}")
        rows = shape[0]
        q = QuantTensor(np.asarray(raw).view(np.uint8).reshape(rows, -1),
                        info.tensor_type, shape)
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"{gguf.path}: tensor {info.name!r} is unreadable (a "
                             f"truncated file?): {e}") from e
    if gguf.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        cfg = gguf.config
        heads = cfg["num_attention_heads"] if "q_proj" in name else \
            cfg["num_key_value_heads"]
        q = QuantTensor(q.raw[_unpermute_rows(rows, heads)], q.qtype, q.shape, q.perm)
    return q


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes convert_hf_to_gguf's permute(w, heads): the file's row
    (h, i, j) of [heads, d/2, 2] is Hugging Face's row (h, j, i) of [heads, 2, d/2]."""
    half = rows // heads // 2
    index = np.arange(rows).reshape(heads, half, 2).transpose(0, 2, 1).reshape(-1)
    return index


def load_gguf_tokenizer(path: str) -> Any:
    """transformers' tokenizer built from the file's metadata."""
    from transformers import AutoTokenizer

    p = Path(path)
    try:
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name,
                                             local_files_only=True)
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: transformers cannot build a tokenizer from this GGUF's "
                             f"metadata ({e}); pass tokenizer= a Hugging Face directory") from e
