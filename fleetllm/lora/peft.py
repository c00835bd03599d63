"""PEFT LoRA adapters on disk: adapter_config.json + adapter_model.safetensors.

`read_adapter` checks everything a request must not get past (the engine calls it when a
request or add_lora names an adapter, so a bad adapter fails that call, not a worker): the
config's fields, every tensor's name and shape, the rank. Supported: plain LoRA (`r`,
`lora_alpha`, rsLoRA, per-module ranks) on the q/k/v/o/gate/up/down projections of the
decoder layers. Refused with a ConfigurationError naming the reason: DoRA, embedding or
lm_head adapters, modules_to_save, LoRA biases, alpha_pattern, a pickled adapter_model.bin
(never unpickled). `load_adapter` then reads the tensors a worker needs.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fleetllm.errors import ConfigurationError

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\."
                  r"lora_([AB])\.weight$")
WEIGHTS = "adapter_model.safetensors"


def _fail(path: str, why: str) -> ConfigurationError:
    return ConfigurationError(f"LoRA adapter {path}: {why}")


@dataclass
class AdapterInfo:
    """What the engine learned checking an adapter: its largest rank, the modules it adapts
    ({layer: {projection name: rank}}) and the scaling of each (alpha / r, or
    alpha / sqrt(r) with rsLoRA)."""

    path: str
    rank: int
    alpha: float
    use_rslora: bool
    modules: dict[int, dict[str, int]] = field(default_factory=dict)

    def scaling(self, rank: int) -> float:
        return self.alpha / (math.sqrt(rank) if self.use_rslora else rank)


def _read_config(path: Path) -> dict[str, Any]:
    file = path / "adapter_config.json"
    try:
        with open(file) as f:
            cfg = json.load(f)
    except FileNotFoundError as e:
        raise _fail(str(path), "adapter_config.json not found: is this a PEFT adapter "
                    "directory?") from e
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(str(path), f"adapter_config.json is unreadable: {e}") from e
    if not isinstance(cfg, dict):
        raise _fail(str(path), "adapter_config.json is not a JSON object")
    return cfg


def _check_config(where: str, cfg: dict[str, Any]) -> None:
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise _fail(where, f"peft_type {kind!r} is not supported (LORA is)")
    if cfg.get("use_dora"):
        raise _fail(where, "DoRA (use_dora) is not supported")
    if cfg.get("modules_to_save"):
        raise _fail(where, f"modules_to_save {cfg['modules_to_save']} is not supported (only "
                    "LoRA deltas on the projections, no fully trained modules)")
    if cfg.get("bias", "none") != "none":
        raise _fail(where, f"bias={cfg['bias']!r} is not supported (LoRA without biases)")
    if cfg.get("alpha_pattern"):
        raise _fail(where, "alpha_pattern (per-module lora_alpha) is not supported")
    if cfg.get("fan_in_fan_out"):
        raise _fail(where, "fan_in_fan_out is not supported (Llama-family Linear layers)")
    targets = cfg.get("target_modules")
    if isinstance(targets, list | tuple | set):
        names = [str(t).rsplit(".", 1)[-1] for t in targets]
        bad = [t for t, n in zip(targets, names, strict=True) if n not in TARGETS]
        if bad:
            raise _fail(where, f"target_modules {bad} are not supported: LoRA applies to "
                        f"{', '.join(TARGETS)} (no embedding or lm_head adapters)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or r < 1:
        raise _fail(where, f"r must be an int >= 1, got {r!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise _fail(where, f"lora_alpha must be a number, got {alpha!r}")


def read_adapter(path: str, max_rank: int, arch: Any | None = None) -> AdapterInfo:
    """Check an adapter directory without loading its weights (the tensor names and shapes
    only); `arch` (the base model's ArchConfig) also checks the shapes against the model."""
    from safetensors import safe_open

    root = Path(path)
    if not root.is_dir():
        raise _fail(path, "not a directory (lora_path must be a local PEFT adapter directory)")
    cfg = _read_config(root)
    _check_config(path, cfg)
    if not (root / WEIGHTS).is_file():
        found = "adapter_model.bin (a pickle, which fleetllm never loads)" \
            if (root / "adapter_model.bin").exists() else "nothing"
        raise _fail(path, f"{WEIGHTS} not found ({found}): save the adapter with "
                    "safe_serialization=True")
    info = AdapterInfo(path, 0, float(cfg["lora_alpha"]), bool(cfg.get("use_rslora")))
    shapes: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    try:
        with safe_open(str(root / WEIGHTS), framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    raise _fail(path, f"tensor {key!r} is not supported: only lora_A/lora_B of "
                                f"{', '.join(TARGETS)} in the decoder layers (no embedding, "
                                "lm_head, DoRA magnitude or bias tensors)")
                layer, _, name, ab = m.groups()
                shapes.setdefault((int(layer), name), {})[ab] = tuple(f.get_slice(key)
                                                                      .get_shape())
    except ConfigurationError:
        raise
    except Exception as e:  # a corrupt or truncated file
        raise _fail(path, f"{WEIGHTS} is unreadable: {e}") from e
    if not shapes:
        raise _fail(path, f"{WEIGHTS} holds no LoRA tensors")
    for (layer, name), ab in sorted(shapes.items()):
        if set(ab) != {"A", "B"}:
            raise _fail(path, f"layer {layer} {name} has lora_{next(iter(ab))} only")
        (r, n_in), (n_out, r_b) = ab["A"], ab["B"]
        if r != r_b:
            raise _fail(path, f"layer {layer} {name}: lora_A rank {r} != lora_B rank {r_b}")
        if r > max_rank:
            raise _fail(path, f"rank {r} (layer {layer} {name}) is above max_lora_rank="
                        f"{max_rank}; raise max_lora_rank")
        if arch is not None:
            want = _module_shape(arch, name)
            if (n_in, n_out) != want or layer >= arch.num_layers:
                raise _fail(path, f"layer {layer} {name} is [{n_in} -> {n_out}], the base "
                            f"model's is [{want[0]} -> {want[1]}] with {arch.num_layers} "
                            "layers: an adapter for another model")
        info.modules.setdefault(layer, {})[name] = r
        info.rank = max(info.rank, r)
    return info


def _module_shape(arch: Any, name: str) -> tuple[int, int]:
    """(in, out) of a projection in the base model."""
    h, d = arch.hidden_size, arch.head_dim
    return {"q_proj": (h, arch.num_heads * d), "k_proj": (h, arch.num_kv_heads * d),
            "v_proj": (h, arch.num_kv_heads * d), "o_proj": (arch.num_heads * d, h),
            "gate_proj": (h, arch.intermediate_size), "up_proj": (h, arch.intermediate_size),
            "down_proj": (arch.intermediate_size, h)}[name]


def load_adapter(path: str, max_rank: int, layers: set[int]
                 ) -> tuple[AdapterInfo, dict[tuple[int, str], tuple[Any, Any]]]:
    """The adapter's (lora_A [r, in], lora_B [out, r]) tensors for the given layers (a
    pipeline stage's), keyed by (layer, projection)."""
    from safetensors import safe_open

    info = read_adapter(path, max_rank)
    out: dict[tuple[int, str], tuple[Any, Any]] = {}
    with safe_open(str(Path(path) / WEIGHTS), framework="pt") as f:
        for layer, modules in info.modules.items():
            if layer not in layers:
                continue
            for name in modules:
                group = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                prefix = f"base_model.model.model.layers.{layer}.{group}.{name}"
                out[(layer, name)] = (f.get_tensor(f"{prefix}.lora_A.weight"),
                                      f.get_tensor(f"{prefix}.lora_B.weight"))
    return info, out


def to_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.dtype != dtype else t
