"""Which ggml type each tensor of a GGUF export gets, by llama-quantize's preset names.

What: PRESETS maps the names llama-quantize takes ("Q4_K_M", "Q8_0", "F16", ...) to the file
type written as general.file_type and the preset's default tensor type; tensor_type() picks one
tensor's type.
How: as convert_hf_to_gguf.py and llama.cpp's src/llama-quant.cpp (llama_tensor_get_type,
tensor_type_fallback) decide for a dense Llama / Qwen model without an imatrix:
- 1-D tensors, norms, MoE routers (ffn_gate_inp) and anything not named *.weight: F32
  (convert_hf_to_gguf, llama-quant.cpp).
- F32 / F16 / BF16 presets: every other tensor in that type.
- Quantized presets start from the default type, then output.weight (and token_embd.weight
  when the embeddings are tied, i.e. there is no output.weight) becomes Q6_K, or Q8_0 when its
  row size is not a multiple of the default's block (a Q8_0 preset keeps Q8_0);
  attn_v: Q6_K on the use_more_bits layers for Q4_K_M / Q5_K_M, Q5_K on the first 4 for
  Q4_K_S; ffn_down: Q6_K on the use_more_bits layers for Q4_K_M / Q5_K_M, Q5_K on the first
  eighth for Q4_K_S. use_more_bits(i, n): i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2.
- Fallback for a row size K the chosen type's block does not divide: Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 when K is not a multiple of 32 either.
Failures: an unknown preset name raises ConfigurationError listing the known ones.
"""

from __future__ import annotations

import re

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from fleetllm.errors import ConfigurationError

T = GGMLQuantizationType
F = LlamaFileType

PRESETS: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    "F32": (F.ALL_F32, T.F32),
    "F16": (F.MOSTLY_F16, T.F16),
    "BF16": (F.MOSTLY_BF16, T.BF16),
    "Q8_0": (F.MOSTLY_Q8_0, T.Q8_0),
    "Q4_0": (F.MOSTLY_Q4_0, T.Q4_0),
    "Q4_1": (F.MOSTLY_Q4_1, T.Q4_1),
    "Q5_0": (F.MOSTLY_Q5_0, T.Q5_0),
    "Q5_1": (F.MOSTLY_Q5_1, T.Q5_1),
    "Q6_K": (F.MOSTLY_Q6_K, T.Q6_K),
    "Q4_K_S": (F.MOSTLY_Q4_K_S, T.Q4_K),
    "Q4_K_M": (F.MOSTLY_Q4_K_M, T.Q4_K),
    "Q5_K_S": (F.MOSTLY_Q5_K_S, T.Q5_K),
    "Q5_K_M": (F.MOSTLY_Q5_K_M, T.Q5_K),
}
_FLOAT = (T.F32, T.F16, T.BF16)
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
_LAYER = re.compile(r"^blk\.(\d+)\.")


def preset_name(qtype: str) -> str:
    """The canonical preset name for `qtype` (any case); ConfigurationError if unknown."""
    name = str(qtype).upper()
    if name not in PRESETS:
        raise ConfigurationError(f"unknown GGUF quantization type {qtype!r}; choose one of "
                                 f"{', '.join(PRESETS)}")
    return name


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's layers that get more bits in the _M mixes (first and last eighth,
    every third in between)."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def fallback(qtype: GGMLQuantizationType, k: int) -> GGMLQuantizationType:
    """tensor_type_fallback: a type whose block divides a row of k weights."""
    if k % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, qtype)
    return qtype if k % GGML_QUANT_SIZES[qtype][0] == 0 else T.F16


def tensor_type(name: str, shape: tuple[int, ...], preset: str, n_layers: int,
                tied: bool) -> GGMLQuantizationType:
    """The type GGUF tensor `name` (numpy `shape`, rows last) gets in `preset`. `tied`: the
    file has no output.weight (token_embd serves as the output too)."""
    ftype, qtype = PRESETS[preset_name(preset)]
    if len(shape) < 2 or not name.endswith(".weight") or name.endswith("_norm.weight") \
            or ".ffn_gate_inp" in name:  # MoE routers: llama-quantize keeps them F32
        return T.F32
    if qtype in _FLOAT:
        return qtype
    k = shape[-1]
    match = _LAYER.match(name)
    layer = int(match.group(1)) if match else -1
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if k % GGML_QUANT_SIZES[qtype][0]:
            qtype = T.Q8_0
        elif qtype != T.Q8_0:
            qtype = T.Q6_K
    elif "attn_v.weight" in name:
        if ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and use_more_bits(layer, n_layers):
            qtype = T.Q6_K
        elif ftype == F.MOSTLY_Q4_K_S and layer < 4:
            qtype = T.Q5_K
    elif "ffn_down" in name:
        if ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and use_more_bits(layer, n_layers):
            qtype = T.Q6_K
        elif ftype == F.MOSTLY_Q4_K_S and layer < n_layers // 8:
            qtype = T.Q5_K
    return fallback(qtype, k)
