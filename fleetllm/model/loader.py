"""Build the model for this rank and fill it from a checkpoint directory.

Weights load from safetensors only (never pickle). Sharded checkpoints are found through
model.safetensors.index.json. Each rank opens the files lazily and reads only its slices.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from fleetllm.config import EngineConfig, hf_tensor_shapes, read_json
from fleetllm.config_quant import QuantConfig
from fleetllm.distributed.parallel_state import get_pp_group, get_tp_group
from fleetllm.errors import ModelLoadError
from fleetllm.model import huge_pages
from fleetllm.model.kernel_choice import dense_weights_kept, select_kernels
from fleetllm.model.llama import LlamaForCausalLM
from fleetllm.progress import ProgressBar


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index} has no weight_map")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise ModelLoadError(f"{f} is listed in {index.name} but missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        extra = " (.bin/.pt checkpoints are not loaded: pickle is unsafe)" if any(
            model_dir.glob("*.bin")) else ""
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}{extra}")
    return files


def build_model(config: EngineConfig, device: torch.device) -> LlamaForCausalLM:
    mc = config.model_config
    dtype = mc.torch_dtype(config.device_config.device)
    load_format = config.load_config.load_format
    # Built directly in its final dtype on its device: no float32 copy of a bf16 checkpoint.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model_class = LlamaForCausalLM
            if mc.arch.num_experts:  # a mixture of experts (bf16/float32 safetensors)
                from fleetllm.model.moe import MoeForCausalLM
                model_class = MoeForCausalLM
            model = model_class(mc.arch, max_position=mc.max_model_len,
                                lm_head=not mc.is_pooling)
    finally:
        torch.set_default_dtype(default_dtype)
    # Before loading (the loaders copy into the parameters in place); not where packing will
    # free the dense weights: the mapping would stay whole while any parameter lives in it.
    quantized = mc.quantized
    if not quantized and load_format == "sharded_state":  # a GGUF model's, saved
        from fleetllm.model.sharded_state import gguf_source
        quantized = gguf_source(mc.model) is not None
    if device.type == "cpu" and dense_weights_kept(model) and not quantized:
        huge_pages.place_parameters(model)
    if mc.is_gguf:  # blocks kept as the file has them (fleetllm/quant/)
        from fleetllm.quant.gguf_loader import load_gguf
        load_gguf(model, mc.model)
    elif load_format == "dummy":
        _init_dummy(model, mc.seed)
    elif load_format == "sharded_state":  # this rank's own tensors (Executor.save_sharded_state)
        from fleetllm.model.sharded_state import load_sharded_state
        load_sharded_state(model, config)
    else:
        _load_safetensors(model, Path(mc.model), mc.quant_config)
    model.eval().requires_grad_(False)
    # load_weight's name -> Parameter index would keep every dense weight alive after packing
    # frees it (a Llama-1B-shaped bf16 model: 2 GB of the process, measured).
    model.__dict__.pop("_param_index", None)
    select_kernels(model)  # after loading: each projection's kernel, chosen once
    return model


def _load_safetensors(model: LlamaForCausalLM, model_dir: Path,
                      quant: QuantConfig | None) -> None:
    """Fill the model from the directory's safetensors files; a quantized checkpoint's
    projections as GGUF blocks (quant/hf_checkpoint.py), packed at the end like a GGUF
    file's."""
    expected = {name for name, _ in model.named_parameters()}
    loaded: set[str] = set()
    files = checkpoint_files(model_dir)
    first_rank = get_tp_group().is_first and get_pp_group().is_first
    groups = [files] if quant else [[f] for f in files]  # a projection's parts may span files
    for group in ProgressBar(groups, desc="Loading safetensors shards", unit="file",
                             disable=len(groups) < 2 or not first_rank):
        path = group[0] if len(group) == 1 else model_dir
        try:
            loaded |= model.load_weights(_tensors(group, quant), path)
        except (SafetensorError, OSError, KeyError, ValueError) as e:
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"{path}: {e}") from e
    if quant:
        from fleetllm.quant.gguf_loader import finish
        finish(model)
    missing = expected - loaded
    if missing:
        raise ModelLoadError(f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. "
                             f"{sorted(missing)[:3]}")


def _tensors(files: list[Path], quant: QuantConfig | None) -> Iterator[tuple[str, Any]]:
    if quant:
        from fleetllm.quant.hf_checkpoint import tensors
        yield from tensors(files, quant)
        return
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def dummy_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The dummy checkpoint's tensor `name`: a function of (seed, name) alone, so every
    tensor-parallel rank slices the same full tensor, and a Hugging Face model given the same
    tensors (the benchmarks' peers) computes the same function."""
    if "norm" in name:
        return torch.ones(shape)
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    gen = torch.Generator().manual_seed(key >> 1)
    return torch.randn(shape, generator=gen) * 0.02


class _LazyDummy:
    """An MoE expert's dummy tensor, made when first read, read as a safetensors slice is
    (`[index]`): under expert parallelism the other ranks' experts are skipped unmade."""

    def __init__(self, name: str, shape: tuple[int, ...], seed: int):
        self.name, self.shape, self.seed = name, shape, seed
        self._full: torch.Tensor | None = None

    def __getitem__(self, index: Any) -> torch.Tensor:
        if self._full is None:
            self._full = dummy_tensor(self.name, self.shape, self.seed)
        return self._full[index]


def _init_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights with the right shapes, reproducible by seed (profiling, benchmarks)."""
    for name, shape in hf_tensor_shapes(model.cfg).items():
        lazy = ".experts." in name
        model.load_weight(name, _LazyDummy(name, shape, seed) if lazy
                          else dummy_tensor(name, shape, seed))
