"""Sharded state: each rank saves the tensors of its own model shard and loads them back
directly, with no slicing of full checkpoint tensors.

A saved directory holds `model-rank-{rank}-part-{part}.safetensors` (configurable pattern;
each rank's tensors under the model's names, as it holds them, split at `max_size` bytes),
`fleetllm_sharded_state.json` (layout, dtype, pattern, files; written last by the driver, so a
directory without it is incomplete), and the source's config, generation config and tokenizer,
so `LLM(path, load_format="sharded_state", ...)` works as is. Tied embeddings are saved once
(safetensors refuses shared memory) and tied again when the model is built.

A GGUF model keeps its quantized layout: each packed copy (a Gguf kernel's, a quantized
embedding's; quant/packed.py) is saved as it is, uint8 under `{module}.packed`, and loaded back
into the same place (quant/gguf_loader.install), so the directory weighs about the .gguf file.
The source file itself is not copied (it would double that) nor referenced (it may move): the
directory gets its config as config.json (the GGUF metadata in Hugging Face's form, as
ModelConfig reads it) and its tokenizer saved by transformers (or the files of a tokenizer
directory given), and the metadata names the source file ("gguf") for the record and for the
loader (no dense weights are placed in huge pages for it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fleetllm.config import EngineConfig, ModelConfig
from fleetllm.distributed.parallel_state import get_pp_group, get_tp_group
from fleetllm.errors import ConfigurationError, ModelLoadError
from fleetllm.kernels.cpu_kernels import LinearKind
from fleetllm.model.moe_experts import FusedExperts

DEFAULT_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
METADATA_FILE = "fleetllm_sharded_state.json"
FORMAT = "fleetllm-sharded-state"
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth")  # weights: the shards replace them
# Every file this process opened to load a sharded state, in order: lets a test check that
# each rank reads only its own files.
OPENED_FILES: list[str] = []


def check_save_args(path: str | os.PathLike, pattern: str | None, max_size: int | None,
                    model_dir: str) -> str:
    """Validate save_sharded_state's arguments (in the driver, before any worker writes);
    returns the pattern to use."""
    pattern = DEFAULT_PATTERN if pattern is None else pattern
    if not isinstance(pattern, str) or "{rank}" not in pattern or "{part}" not in pattern:
        raise ConfigurationError(f"pattern: must contain {{rank}} and {{part}}, got "
                                 f"{pattern!r}")
    try:
        name = pattern.format(rank=0, part=0)
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigurationError(f"pattern: {pattern!r} is not a format string with only "
                                 f"{{rank}} and {{part}} ({e})") from e
    if os.sep in name or name == METADATA_FILE:
        raise ConfigurationError(f"pattern: {pattern!r} must name a file inside the directory")
    if max_size is not None and (isinstance(max_size, bool) or not isinstance(max_size, int)
                                 or max_size <= 0):
        raise ConfigurationError(f"max_size: must be a number of bytes > 0, got {max_size!r}")
    if Path(path).resolve() == Path(model_dir).resolve():
        raise ConfigurationError(f"path: {path} is the model's own directory; save the "
                                 "sharded state into another one")
    return pattern


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers by name, each tensor once (a tied
    parameter appears under its first name only)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    # A GGUF model's packed copies as they are (an embedding's first: a tied LM head's kernel
    # shares it); a projection whose weight lives only in another kernel's packed copy
    # (kernel_choice.py) is saved dense, as loading expects it (and packs it again).
    modules = list(model.named_modules())
    held: set[int] = set()
    for prefix, module in modules:
        packed = getattr(module, "packed", None)
        if isinstance(module, FusedExperts) and packed is not None:
            raise ConfigurationError(f"{prefix}: a GGUF MoE model's quantized experts cannot "
                                     "be saved as sharded state yet; load the .gguf file")
        if packed is not None:
            out[f"{prefix}.packed"] = packed
            held.add(id(packed))
    for prefix, module in modules:
        kernel = getattr(module, "kernel", None)
        if kernel is None or getattr(module, "weight", None) is not None or \
                isinstance(module, FusedExperts):  # the experts' w13 / w2 are parameters
            continue
        if kernel.kind != LinearKind.GGUF:
            out[f"{prefix}.weight"] = kernel.to_dense()
        elif id(kernel.tensor) not in held:
            out[f"{prefix}.packed"] = kernel.tensor
            held.add(id(kernel.tensor))
    return out


def save_sharded_state(model: torch.nn.Module, path: str | os.PathLike, rank: int,
                       pattern: str | None = None, max_size: int | None = None) -> list[str]:
    """Write `model`'s tensors (this rank's shard) to `path` in parts of at most `max_size`
    bytes (a tensor larger than that gets a part of its own). Returns the file names."""
    pattern = pattern or DEFAULT_PATTERN
    os.makedirs(path, exist_ok=True)
    files: list[str] = []
    part: dict[str, torch.Tensor] = {}
    part_bytes = 0
    storages: set[int] = set()

    def flush() -> None:
        nonlocal part, part_bytes
        name = pattern.format(rank=rank, part=len(files))
        save_file(part, os.path.join(path, name), metadata={"format": "pt",
                                                            "fleetllm_rank": str(rank)})
        files.append(name)
        part, part_bytes = {}, 0

    for name, tensor in state_tensors(model).items():
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        elif t.untyped_storage().data_ptr() in storages or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)  # safetensors: no sharing
        storages.add(t.untyped_storage().data_ptr())
        size = t.numel() * t.element_size()
        if part and max_size is not None and part_bytes + size > max_size:
            flush()
        part[name] = t
        part_bytes += size
    if part or not files:
        flush()
    return files


def copy_model_files(model_config: ModelConfig, path: str | os.PathLike) -> None:
    """Copy config.json, generation_config.json, the tokenizer files (and the other small
    files) of the checkpoint beside the shards; never its weights. A GGUF file's config and
    tokenizer are written instead (see the module docstring)."""
    model = Path(model_config.model)
    sources = [] if model_config.is_gguf else [model]
    if model_config.tokenizer and Path(model_config.tokenizer) != model:
        sources.append(Path(model_config.tokenizer))
    if model_config.is_gguf:
        from fleetllm.quant.gguf_checkpoint import load_gguf_tokenizer, open_gguf
        config = open_gguf(model_config.model).config
        (Path(path) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if not sources:  # the file's own tokenizer
            load_gguf_tokenizer(model_config.model).save_pretrained(str(path))
    for source in sources:
        for f in sorted(source.iterdir()):
            if (not f.is_file() or f.name.endswith(_NOT_COPIED) or f.name == METADATA_FILE
                    or f.name == "model.safetensors.index.json"):
                continue
            if source != model and (Path(path) / f.name).exists():
                continue  # the model's own config.json wins over the tokenizer dir's
            shutil.copyfile(f, Path(path) / f.name)


def write_metadata(path: str | os.PathLike, config: EngineConfig, pattern: str,
                   files: list[list[str]]) -> None:
    """Name the parallel layout and every rank's files. Written after all the shards."""
    pc = config.parallel_config
    dtype = config.model_config.torch_dtype(config.device_config.device)
    meta = {"format": FORMAT, "version": 1,
            "tensor_parallel_size": pc.tensor_parallel_size,
            "pipeline_parallel_size": pc.pipeline_parallel_size,
            "enable_expert_parallel": pc.enable_expert_parallel,
            "world_size": pc.world_size, "dtype": str(dtype).removeprefix("torch."),
            "pattern": pattern, "files": {str(rank): f for rank, f in enumerate(files)}}
    mc = config.model_config
    source = None
    if mc.is_gguf:
        source = Path(mc.model).name
    elif config.load_config.load_format == "sharded_state":  # saved again: its source's
        source = gguf_source(mc.model)
    if source:
        meta["gguf"] = source
    tmp = Path(path) / f".{METADATA_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, Path(path) / METADATA_FILE)


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    meta_path = Path(path) / METADATA_FILE
    if not meta_path.exists():
        raise ModelLoadError(f"load_format='sharded_state': {path} has no {METADATA_FILE}; "
                             "it is not a complete Executor.save_sharded_state directory")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{meta_path} is not valid JSON ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ModelLoadError(f"{meta_path} is not a fleetllm sharded state description")
    return meta


def gguf_source(path: str | os.PathLike) -> str | None:
    """The name of the GGUF file whose packed copies the sharded state at path holds (None:
    none, or the state cannot be read: loading says why)."""
    try:
        return read_metadata(path).get("gguf")
    except ModelLoadError:
        return None


def check_layout(meta: dict[str, Any], config: EngineConfig, path: str | os.PathLike) -> None:
    pc = config.parallel_config
    saved = (meta.get("tensor_parallel_size"), meta.get("pipeline_parallel_size"))
    if saved != (pc.tensor_parallel_size, pc.pipeline_parallel_size):
        raise ConfigurationError(
            f"tensor_parallel_size/pipeline_parallel_size: {path} holds a sharded state saved "
            f"with tensor_parallel_size={saved[0]}, pipeline_parallel_size={saved[1]} (world "
            f"size {meta.get('world_size')}), but this engine has tensor_parallel_size="
            f"{pc.tensor_parallel_size}, pipeline_parallel_size={pc.pipeline_parallel_size}; "
            "load it with the saved layout, or load the original checkpoint")
    saved_ep = bool(meta.get("enable_expert_parallel", False))
    if saved_ep != pc.enable_expert_parallel and config.model_config.arch.num_experts \
            and pc.tensor_parallel_size > 1:  # whole experts a rank, or a slice of each
        raise ConfigurationError(
            f"enable_expert_parallel: {path} holds a sharded state saved with "
            f"enable_expert_parallel={saved_ep}, this engine has "
            f"{pc.enable_expert_parallel}; load it with the saved setting")


def load_sharded_state(model: torch.nn.Module, config: EngineConfig) -> None:
    """Fill `model` (this rank's shard) from this rank's files only: each saved tensor is
    copied straight into the parameter of the same name, bypassing the slicing loaders."""
    path = Path(config.model_config.model)
    meta = read_metadata(path)
    check_layout(meta, config, path)
    tp, pp = get_tp_group(), get_pp_group()
    rank = pp.rank_in_group * tp.world_size + tp.rank_in_group
    files = meta.get("files", {}).get(str(rank))
    if not files:
        raise ModelLoadError(f"{path / METADATA_FILE} lists no files for rank {rank}")
    targets = state_tensors(model)
    dtype = config.model_config.torch_dtype(config.device_config.device)
    loaded: set[str] = set()
    for name in files:
        file = path / name
        if not file.exists():
            raise ModelLoadError(f"{file} is listed in {METADATA_FILE} but missing")
        OPENED_FILES.append(str(file))
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key.endswith(".packed"):  # a GGUF model's quantized copy
                        loaded.add(_install_packed(model, key, f.get_tensor(key), dtype, file))
                        continue
                    target = targets.get(key)
                    if target is None:
                        raise ModelLoadError(f"{file}: tensor {key!r} has no place in this "
                                             "model")
                    if tuple(f.get_slice(key).get_shape()) != tuple(target.shape):
                        raise ModelLoadError(
                            f"{file}: tensor {key!r} has shape "
                            f"{tuple(f.get_slice(key).get_shape())}, the model's is "
                            f"{tuple(target.shape)}")
                    with torch.no_grad():
                        target.copy_(f.get_tensor(key))  # casts if the dtype differs
                    loaded.add(key)
        except (SafetensorError, OSError) as e:
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"{file} is not a readable safetensors file: {e}") from e
    missing = set(targets) - loaded
    if missing:
        raise ModelLoadError(f"{path}: rank {rank}'s files lack {len(missing)} tensors, e.g. "
                             f"{sorted(missing)[:3]}")


def _install_packed(model: torch.nn.Module, key: str, packed: torch.Tensor, dtype: torch.dtype,
                    file: Path) -> str:
    """Put a saved packed copy (`{module}.packed`) back in its module, checked against the
    module's dense shape; returns the name of the weight it stands for."""
    from fleetllm.quant.gguf_loader import install
    from fleetllm.quant.packed import unpack

    prefix = key.removesuffix(".packed")
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        module = None
    weight = getattr(module, "weight", None)
    if weight is None:
        raise ModelLoadError(f"{file}: tensor {key!r} has no place in this model")
    try:
        parts = unpack(packed) if packed.dtype == torch.uint8 and packed.dim() == 1 else None
    except (ValueError, RuntimeError, IndexError):
        parts = None
    if not parts:
        raise ModelLoadError(f"{file}: tensor {key!r} is not a packed quantized weight")
    shape = (sum(q.shape[0] for q in parts), parts[0].shape[1])
    if shape != tuple(weight.shape):
        raise ModelLoadError(f"{file}: tensor {key!r} holds a {shape} weight, the model's is "
                             f"{tuple(weight.shape)}")
    if packed.data_ptr() % 64:  # the kernels read 8-byte words; allocations are aligned
        packed = packed.clone()
    install(model, module, packed, dtype)
    return f"{prefix}.weight"
