"""`bench throughput --lora N`: the cost of serving LoRA adapters.

N random adapters in PEFT's format (adapter_config.json + adapter_model.safetensors, what
`PeftModel.save_pretrained` writes and what vLLM and fleetllm load) are written for the
benchmark's checkpoint to a temporary directory; fleetllm runs the workload base-only (LoRA
off) and with LoRA on (enable_lora, max_loras=N), the requests assigned to the adapters
round-robin, and the ratio of the two throughputs is printed. The adapters' B matrices are
not zero (PEFT initialises B to zero, which would change nothing), so every adapter changes
the outputs: the count of requests whose tokens differ from base-only shows they were applied.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora", type=int, default=0, metavar="N",
                        help="also run with N random LoRA adapters (requests round-robin, "
                             "max_loras=N) and print the ratio to base-only throughput "
                             "(default: 0, no LoRA run)")
    parser.add_argument("--lora-rank", type=int, default=16,
                        help="rank of the --lora adapters (default 16)")
    parser.add_argument("--lora-targets", default=",".join(DEFAULT_TARGETS),
                        help="modules the --lora adapters change, comma-separated (default "
                             f"{','.join(DEFAULT_TARGETS)}; also gate_proj, up_proj, "
                             "down_proj)")


def module_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each LoRA-targetable linear layer of a Llama-family
    checkpoint, from its config.json."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    inter = config["intermediate_size"]
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim),
            "v_proj": (hidden, kv * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def make_adapters(model_dir: str | Path, out_dir: str | Path, n: int, rank: int = 16,
                  targets: tuple[str, ...] | list[str] = DEFAULT_TARGETS, seed: int = 0,
                  scale: float = 1.0) -> list[Path]:
    """Write n random PEFT LoRA adapters for the checkpoint at model_dir into out_dir
    (adapter-0, adapter-1, ...) and return their directories. A is Kaiming-uniform as PEFT
    initialises it; B is N(0, scale / sqrt(rank)) instead of PEFT's zeros, so that each
    adapter changes the outputs (lora_alpha = rank: the update is B @ A)."""
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = module_shapes(config)
    unknown = sorted(set(targets) - set(shapes))
    if unknown or not targets:
        raise ValueError(f"lora targets: {unknown or 'none given'}; known: {sorted(shapes)}")
    if n < 1 or rank < 1:
        raise ValueError(f"need n >= 1 adapters of rank >= 1, got n={n}, rank={rank}")
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for i in range(n):
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for target in targets:
                fan_in, fan_out = shapes[target]
                block = "self_attn" if target in _ATTENTION else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
                bound = 1 / math.sqrt(fan_in)
                a = (torch.rand(rank, fan_in, generator=gen) * 2 - 1) * bound
                b = torch.randn(fan_out, rank, generator=gen) * (scale / math.sqrt(rank))
                tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
                tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
        path = Path(out_dir) / f"adapter-{i}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        (path / "adapter_config.json").write_text(json.dumps(_adapter_config(
            str(model_dir), rank, list(targets)), indent=1))
        paths.append(path)
    return paths


def _adapter_config(base: str, rank: int, targets: list[str]) -> dict[str, Any]:
    """PEFT's adapter_config.json for a plain LoRA (the fields PEFT 0.21 writes that matter
    here; PEFT fills in the rest with its defaults)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": rank, "lora_alpha": rank, "lora_dropout": 0.0, "target_modules": targets,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}}


class Adapters:
    """The --lora adapters of one benchmark run, in a temporary directory removed by
    close()."""

    def __init__(self, args: argparse.Namespace, model_dir: str):
        self.n = args.lora
        self.rank = args.lora_rank
        self.targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
        self._dir = tempfile.mkdtemp(prefix="fleetllm-lora-")
        try:
            self.paths = make_adapters(model_dir, self._dir, self.n, self.rank, self.targets)
        except BaseException:
            self.close()
            raise

    def engine_kwargs(self, kwargs: dict) -> dict:
        return {**kwargs, "enable_lora": True, "max_loras": self.n,
                "max_lora_rank": max(self.rank, kwargs.get("max_lora_rank") or 0)}

    def requests(self) -> list:
        from fleetllm.lora.request import LoRARequest

        return [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(self.paths)]

    @property
    def label(self) -> str:
        return f"fleetllm ({self.n} LoRA r={self.rank})"

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def report(adapters: Adapters, results: dict, figures: dict) -> None:
    """Print and record the LoRA run's throughput against base-only."""
    base, base_out, _ = results["fleetllm"]
    seconds, outputs, _ = results[adapters.label]
    differ = sum(a != b for a, b in zip(base_out, outputs, strict=True))
    figures["lora"] = {"adapters": adapters.n, "rank": adapters.rank,
                       "targets": list(adapters.targets), "seconds": seconds,
                       "base_seconds": base, "throughput_ratio": base / seconds,
                       "outputs_differing_from_base": differ}
    print(f"ratio {adapters.n} LoRA adapters (r={adapters.rank}, "
          f"{','.join(adapters.targets)}) / base-only: {base / seconds:.3f}x throughput  "
          f"(outputs differing from base-only {differ}/{len(outputs)})")
