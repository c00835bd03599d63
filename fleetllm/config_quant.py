"""A Hugging Face checkpoint's `quantization_config` (config.json), read and checked: AWQ,
GPTQ and compressed-tensors (llm-compressor), the formats vLLM loads (config layer: errors
only). quant/hf_checkpoint.py reads their tensors into GGUF blocks (quant/groups.py).

What is read: AWQ "gemm" 4-bit, any group size that is a multiple of 32, zero points; GPTQ 4
and 8-bit, sym and asym, desc_act (g_idx), checkpoint_format "gptq" (zeros
stored minus one) and "gptq_v2"; compressed-tensors "pack-quantized" (int4/int8 weights per
group or channel) and "int-quantized" (W8A8: int8 weights per channel; with int8 input
activations, dynamic or static, every projection rounds x to int8 per row, as vLLM's dynamic
per-token W8A8 does: int8_activations). Anything else is a ModelLoadError naming the field,
raised when ModelConfig is built, before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetllm.errors import ConfigurationError, ModelLoadError

METHODS = ("awq", "gptq", "compressed-tensors")
# vLLM's names for the same checkpoints' other kernels
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "marlin": "gptq",
           "compressed_tensors": "compressed-tensors"}


@dataclass(frozen=True)
class QuantConfig:
    """method: one of METHODS; bits; group_size (-1: one group per row); zero_point (AWQ,
    GPTQ asym: zeros stored); gptq_v1_zeros (GPTQ "gptq": each stored zero is one less);
    ignore: module names or "re:" patterns left unquantized (compressed-tensors)."""

    method: str
    bits: int
    group_size: int
    zero_point: bool = True
    gptq_v1_zeros: bool = False
    ignore: tuple[str, ...] = field(default=())
    int8_activations: bool = False  # W8A8: x quantized to int8 per row for the GEMMs


def resolve(asked: str | None, hf_config: dict[str, Any], where: str) -> QuantConfig | None:
    """The checkpoint's QuantConfig (None: not quantized). `asked`, ModelConfig.quantization
    (vLLM's --quantization), must name the checkpoint's method when given."""
    asked = ALIASES.get(asked, asked) if asked else None
    raw = hf_config.get("quantization_config")
    if raw is None:
        if asked is not None:
            raise ConfigurationError(f"quantization: {asked!r} is not supported for {where}: it "
                                     "has no quantization_config (nothing to dequantize)")
        return None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{where}: quantization_config must be an object, got {raw!r}")
    method = ALIASES.get(str(raw.get("quant_method", "")).lower(),
                         str(raw.get("quant_method", "")).lower())
    if method not in METHODS:
        raise ModelLoadError(f"{where}: quantization method {raw.get('quant_method')!r} is not "
                             f"supported (fleetllm reads {', '.join(METHODS)} and GGUF files)")
    if asked is not None and asked != method:
        raise ConfigurationError(f"quantization: {asked!r} is not supported for {where}, "
                                 f"which is {method!r}")
    try:
        return {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed}[method](raw)
    except ModelLoadError as e:  # what is not supported, said with the checkpoint's name
        raise ModelLoadError(f"{where}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a field of a wrong type
        raise ModelLoadError(f"{where}: quantization_config: {e}") from e


def _unsupported(what: str) -> ModelLoadError:
    return ModelLoadError(f"quantization_config: {what} is not supported")


def _group(size: Any) -> int:
    size = int(size)
    if size != -1 and (size <= 0 or size % 32):
        raise _unsupported(f"group_size {size} (multiples of 32, or -1 per channel, are)")
    return size


def _awq(raw: dict[str, Any]) -> QuantConfig:
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise _unsupported(f"AWQ version {raw.get('version')!r} (\"gemm\" is)")
    bits = int(raw.get("bits", raw.get("w_bit", 4)))
    if bits != 4:
        raise _unsupported(f"{bits}-bit AWQ (4-bit is)")
    if not raw.get("zero_point", True):
        raise _unsupported("AWQ without zero points (zero_point: false)")
    return QuantConfig("awq", 4, _group(raw.get("group_size", raw.get("q_group_size", 128))))


def _gptq(raw: dict[str, Any]) -> QuantConfig:
    bits = int(raw["bits"])
    sym = bool(raw.get("sym", True))
    if bits not in (4, 8):
        raise _unsupported(f"{bits}-bit GPTQ (4 and 8-bit are)")
    fmt = str(raw.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _unsupported(f"GPTQ checkpoint_format {fmt!r} (\"gptq\" and \"gptq_v2\" are)")
    return QuantConfig("gptq", bits, _group(raw.get("group_size", 128)), zero_point=not sym,
                       gptq_v1_zeros=fmt == "gptq")


def _compressed(raw: dict[str, Any]) -> QuantConfig:
    groups = raw.get("config_groups") or {}
    if len(groups) != 1:
        raise _unsupported(f"compressed-tensors with {len(groups)} config_groups (one is)")
    scheme = next(iter(groups.values()))
    fmt = scheme.get("format") or raw.get("format")
    if fmt not in ("pack-quantized", "int-quantized"):
        raise _unsupported(f"compressed-tensors format {fmt!r} (\"pack-quantized\" and "
                           "\"int-quantized\" are)")
    w = scheme.get("weights") or {}
    bits, kind, strategy = int(w.get("num_bits", 0)), w.get("type"), w.get("strategy")
    if kind != "int" or bits not in (4, 8):
        raise _unsupported(f"compressed-tensors weights of type {kind!r}, {bits} bits "
                           "(int 4 and 8-bit are)")
    if strategy not in ("group", "channel"):
        raise _unsupported(f"compressed-tensors weight strategy {strategy!r} (\"group\" and "
                           "\"channel\" are)")
    sym = bool(w.get("symmetric", True))
    acts = scheme.get("input_activations")
    if acts and (acts.get("type") != "int" or int(acts.get("num_bits", 0)) != 8):
        raise _unsupported(f"compressed-tensors input activations {acts.get('type')!r} "
                           f"{acts.get('num_bits')}-bit (none, or int8, are)")
    targets = scheme.get("targets") or []
    if targets != ["Linear"]:
        raise _unsupported(f"compressed-tensors targets {targets!r} ([\"Linear\"] is)")
    group = _group(w.get("group_size") or -1) if strategy == "group" else -1
    return QuantConfig("compressed-tensors", bits, group, zero_point=not sym,
                       ignore=tuple(raw.get("ignore") or ()), int8_activations=bool(acts))
