"""Hugging Face checkpoint directory -> GGUF file (llama.cpp's format), quantized.

What: export_gguf(hf_dir, out_path, qtype) writes a .gguf the way llama.cpp's
convert_hf_to_gguf.py followed by llama-quantize would: LlamaForCausalLM / MistralForCausalLM
as arch "llama", Qwen2ForCausalLM as "qwen2", Qwen3ForCausalLM as "qwen3", Qwen3MoeForCausalLM /
Qwen2MoeForCausalLM as "qwen3moe" / "qwen2moe", MixtralForCausalLM as "llama" with
llama.expert_count (each layer's experts stacked into 3-D
ffn_{gate,up,down}_exps tensors, the router F32, the shared expert's gate 1-D; a dense layer of
mlp_only_layers has no GGUF name there and is refused); tensor names from
gguf's TensorNameMap (token_embd, blk.N.attn_q ..., output_norm, output); for "llama" the q/k
rows permuted into llama.cpp's rope layout (LlamaModel.permute); no output tensor when the
embeddings are tied; the {arch}.* hyperparameters, rope scaling (linear, yarn; llama3 as a
rope_freqs tensor) and the tokenizer (gguf_vocab). Used by the tests and benchmarks to make
small files, and by `fleetllm quantize`.
How: safetensors are opened lazily; every tensor's type is decided first (gguf_mix: the
llama-quantize preset rules), the header and tensor infos are written, then each tensor is
loaded as float32, permuted, quantized (blocks.quantize) and appended: memory follows the
largest tensor, not the model (a 187M-weight bf16 checkpoint with a 65M-weight embedding:
0.7 GB resident). The file is written as .<name>.tmp-<pid> beside the target and renamed
over it at the end, so a crash leaves no partial .gguf. With llama_quantize=<path of
llama-quantize>, an unquantized GGUF is written to a temporary file instead (BF16 or F16 when
every checkpoint weight is, else F32: no rounding before llama.cpp's) and llama.cpp's own tool
quantizes it to `qtype`.
Failures: an unknown architecture, qtype or rope scaling type, a missing config.json /
safetensors / tokenizer, or a checkpoint tensor with no GGUF name raise ConfigurationError
naming it; llama-quantize exiting non-zero raises ModelLoadError with the end of its output.
The temporary files are removed on every failure.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from fleetllm.errors import ConfigurationError, ModelLoadError
from fleetllm.quant import blocks
from fleetllm.quant.gguf_mix import PRESETS, preset_name, tensor_type
from fleetllm.quant.gguf_vocab import add_tokenizer

ARCHITECTURES: dict[str, gguf.MODEL_ARCH] = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE,
    "Qwen2MoeForCausalLM": gguf.MODEL_ARCH.QWEN2MOE,
    "MixtralForCausalLM": gguf.MODEL_ARCH.LLAMA,  # with llama.expert_count, as llama.cpp's
}
_MOE = (gguf.MODEL_ARCH.QWEN3MOE, gguf.MODEL_ARCH.QWEN2MOE)
_SKIPPED = (".rotary_emb.inv_freq",)
# an MoE checkpoint's per-expert tensor: stacked into one 3-D GGUF tensor per layer and part
_EXPERT = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\."
                     r"(\w+\.weight)")


@dataclass
class _Tensor:
    name: str  # GGUF name
    shape: tuple[int, ...]  # numpy order (rows last)
    qtype: gguf.GGMLQuantizationType
    load: Callable[[], np.ndarray]


def export_gguf(hf_dir: str | os.PathLike[str], out_path: str | os.PathLike[str],
                qtype: str = "Q8_0", *, progress: bool = True,
                llama_quantize: str | None = None) -> Path:
    """Write the Hugging Face checkpoint in `hf_dir` as a GGUF file of preset `qtype` (a
    llama-quantize name: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q6_K, Q4_K_S, Q4_K_M,
    Q5_K_S, Q5_K_M) at `out_path`; returns the path written."""
    hf, out = Path(hf_dir), Path(out_path)
    preset = preset_name(qtype)
    if out.is_dir():
        raise ConfigurationError(f"GGUF output {out} is a directory; give a file name")
    out.parent.mkdir(parents=True, exist_ok=True)
    if llama_quantize is None or preset == "F32":
        with _replacing(out) as tmp:
            _write(hf, tmp, preset, progress)
        return out
    tool = Path(llama_quantize)
    if not (tool.is_file() and os.access(tool, os.X_OK)):
        raise ConfigurationError(f"llama-quantize {tool} is not an executable file")
    source = out.with_name(f".{out.name}.src-{os.getpid()}")
    try:
        _write(hf, source, _lossless_preset(hf), progress)
        with _replacing(out) as tmp:
            # its log quotes token text cut at byte limits: not always UTF-8
            run = subprocess.run([str(tool), str(source), str(tmp), preset], capture_output=True,
                                 text=True, errors="replace", check=False)
            if run.returncode != 0 or not tmp.is_file():
                tail = (run.stdout + run.stderr)[-2000:]
                raise ModelLoadError(f"{tool} {preset} exited {run.returncode}:\n{tail}")
    finally:
        source.unlink(missing_ok=True)
    return out


@contextlib.contextmanager
def _replacing(out: Path) -> Iterator[Path]:
    """A temporary path beside `out`, renamed over it when the block succeeds."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _write(hf: Path, path: Path, preset: str, progress: bool) -> None:
    config = _read_config(hf)
    arch_name = config["architectures"][0]
    arch = ARCHITECTURES[arch_name]
    tensors, n_vocab = _plan(hf, config, arch, preset)
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[arch])
    try:
        _add_metadata(writer, hf, config, arch, preset, n_vocab)
        add_tokenizer(writer, hf, n_vocab)
        for t in tensors:
            nbytes = blocks.row_bytes(t.qtype, t.shape[-1])
            byte_shape = (*t.shape[:-1], nbytes)
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8),
                                   math.prod(byte_shape), raw_dtype=t.qtype)
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        from fleetllm.progress import ProgressBar

        total = sum(math.prod(t.shape) for t in tensors)
        with ProgressBar(total=total, desc=f"GGUF {preset}", unit="w", unit_scale=True,
                         disable=not progress) as bar:
            for t in tensors:
                bar.set_postfix_str(t.name, refresh=False)
                writer.write_tensor_data(blocks.quantize(t.load(), t.qtype))
                bar.update(math.prod(t.shape))
    finally:
        writer.close()


def _read_config(hf: Path) -> dict[str, Any]:
    path = hf / "config.json"
    if not path.is_file():
        raise ConfigurationError(f"{hf} is not a Hugging Face checkpoint: no config.json")
    config = json.loads(path.read_text(encoding="utf-8"))
    archs = config.get("architectures") or [None]
    if archs[0] not in ARCHITECTURES:
        raise ConfigurationError(f"{hf}: architecture {archs[0]!r} cannot be exported to GGUF; "
                                 f"supported: {', '.join(ARCHITECTURES)}")
    config.update(config.get("text_config") or {})
    return config


def _head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """convert_hf_to_gguf's view of the rope settings: rope_parameters (transformers 5) or
    rope_scaling, with rope_theta from the top level where they lack it."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    if "rope_theta" not in rope and config.get("rope_theta") is not None:
        rope["rope_theta"] = config["rope_theta"]
    return rope


def _checkpoint(hf: Path) -> dict[str, Path]:
    """Every tensor name of the safetensors checkpoint -> its file."""
    from safetensors import safe_open

    index = hf / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
        missing = sorted({f for f in weight_map.values() if not (hf / f).is_file()})
        if missing or not weight_map:
            raise ConfigurationError(f"{index} lists no weights or missing files: {missing[:3]}")
        return {name: hf / f for name, f in weight_map.items()}
    files = sorted(hf.glob("*.safetensors"))
    if not files:
        raise ConfigurationError(f"{hf} has no *.safetensors weights (.bin is not read)")
    names: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names.update(dict.fromkeys(st.keys(), f))
    return names


def _lossless_preset(hf: Path) -> str:
    """The float type that holds every checkpoint weight exactly: llama-quantize's input."""
    from safetensors import safe_open

    dtypes = set()
    for name, path in _checkpoint(hf).items():
        with safe_open(str(path), framework="pt") as st:
            dtypes.add(st.get_slice(name).get_dtype())
    return dtypes.pop() if dtypes in ({"BF16"}, {"F16"}) else "F32"


def _loader(path: Path, name: str, permute: tuple[int, int] | None) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        import torch
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as st:
            w = st.get_tensor(name).to(torch.float32).numpy()
        if w.ndim == 2 and w.shape[0] == 1 and name.endswith("shared_expert_gate.weight"):
            w = w[0]
        if permute is not None:  # LlamaModel.permute: rope pairs (i, i + d/2) -> (2i, 2i + 1)
            heads = permute[1]
            w = (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
                 .swapaxes(1, 2).reshape(w.shape))
        return w
    return load


def _plan(hf: Path, config: dict[str, Any], arch: gguf.MODEL_ARCH,
          preset: str) -> tuple[list[_Tensor], int]:
    """The tensors to write, in file order, and the vocabulary size (embedding rows)."""
    from safetensors import safe_open

    n_layers = config["num_hidden_layers"]
    n_head = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_head
    names = _checkpoint(hf)
    tied = "lm_head.weight" not in names or bool(config.get("tie_word_embeddings"))
    name_map = gguf.get_tensor_name_map(arch, n_layers)
    found: list[tuple[str, str, tuple[int, ...], tuple[int, int] | None]] = []
    unknown = []
    experts: dict[str, dict[int, str]] = {}  # merged name -> expert -> checkpoint name
    for hf_name, path in names.items():
        if hf_name.endswith(_SKIPPED) or (tied and hf_name == "lm_head.weight"):
            continue
        if (m := _EXPERT.fullmatch(hf_name)) is not None:
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = hf_name
            continue
        new = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if new is None:
            unknown.append(hf_name)
            continue
        with safe_open(str(path), framework="pt") as st:
            shape = tuple(st.get_slice(hf_name).get_shape())
        if new.endswith("ffn_gate_inp_shexp.weight"):  # [1, H] -> [H], as llama.cpp reads it
            shape = shape[1:]
        permute = None
        if arch == gguf.MODEL_ARCH.LLAMA and ".attn_q." in new:
            permute = (n_head, n_head)
        elif arch == gguf.MODEL_ARCH.LLAMA and ".attn_k." in new:
            permute = (n_head, n_kv)
        found.append((new, hf_name, shape, permute))
    if unknown:
        raise ConfigurationError(f"{hf}: {len(unknown)} checkpoint tensors have no GGUF name "
                                 f"for {arch.name.lower()}, e.g. {sorted(unknown)[:3]}")
    embed = next((shape for new, _, shape, _ in found if new == "token_embd.weight"), None)
    if embed is None:
        raise ConfigurationError(f"{hf}: the checkpoint has no token embeddings")
    tensors = [_Tensor(new, shape, tensor_type(new, shape, preset, n_layers, tied),
                       _loader(names[hf_name], hf_name, permute))
               for new, hf_name, shape, permute in found]
    tensors += _expert_tensors(hf, experts, names, name_map, preset, n_layers, tied)
    if (freqs := _llama3_rope_factors(config, arch)) is not None:
        tensors.append(_Tensor("rope_freqs.weight", freqs.shape, gguf.GGMLQuantizationType.F32,
                               lambda: freqs))
    tensors.sort(key=_file_order)
    return tensors, embed[0]


def _expert_tensors(hf: Path, experts: dict[str, dict[int, str]], names: dict[str, Path],
                    name_map: Any, preset: str, n_layers: int, tied: bool) -> list[_Tensor]:
    """An MoE layer's experts as convert_hf_to_gguf writes them: each part's matrices stacked
    into one [experts, rows, cols] tensor (blk.N.ffn_{gate,up,down}_exps), typed as a 2-D
    tensor of its rows would be (ffn_down's more bits on the _M mixes' layers)."""
    from safetensors import safe_open

    out = []
    for merged, by_expert in experts.items():
        new = name_map.get_name(merged, try_suffixes=(".weight",))
        if new is None or sorted(by_expert) != list(range(len(by_expert))):
            raise ConfigurationError(f"{hf}: experts {sorted(by_expert)[:8]} of {merged} "
                                     "cannot be written as one GGUF expert tensor")
        order = [by_expert[e] for e in range(len(by_expert))]
        with safe_open(str(names[order[0]]), framework="pt") as st:
            rows, cols = st.get_slice(order[0]).get_shape()
        shape = (len(order), rows, cols)
        out.append(_Tensor(new, shape, tensor_type(new, shape[1:], preset, n_layers, tied),
                           _stacked_loader([(names[n], n) for n in order])))
    return out


def _stacked_loader(parts: list[tuple[Path, str]]) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        return np.stack([_loader(path, name, None)() for path, name in parts])
    return load


def _file_order(t: _Tensor) -> tuple[int, int, str]:
    """token_embd and rope_freqs, the blocks in layer order, then output_norm and output."""
    if t.name.startswith("blk."):
        return (1, int(t.name.split(".")[1]), t.name)
    return (2 if t.name.startswith("output") else 0, 0, t.name)


def _llama3_rope_factors(config: dict[str, Any], arch: gguf.MODEL_ARCH) -> np.ndarray | None:
    """LlamaModel.generate_extra_tensors: the per-frequency factors of llama3 rope scaling."""
    rope = _rope(config)
    if arch != gguf.MODEL_ARCH.LLAMA or rope["rope_type"] != "llama3":
        return None
    dim = _head_dim(config)
    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _add_metadata(w: gguf.GGUFWriter, hf: Path, config: dict[str, Any],
                  arch: gguf.MODEL_ARCH, preset: str, n_vocab: int) -> None:
    w.add_name(str(config.get("_name_or_path") or hf.resolve().name))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(PRESETS[preset][0])
    w.add_block_count(config["num_hidden_layers"])
    if (n_ctx := config.get("max_position_embeddings")) is not None:
        w.add_context_length(n_ctx)
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    w.add_key_length(_head_dim(config))
    w.add_value_length(_head_dim(config))
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    w.add_vocab_size(n_vocab)  # the embedding rows, as the token list is padded to
    if arch == gguf.MODEL_ARCH.LLAMA:
        w.add_rope_dimension_count(_head_dim(config))
    if arch in _MOE or config.get("num_local_experts"):  # Mixtral: experts of the FFN width
        w.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
    if arch in _MOE:
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        # llama.cpp does not read it (qwen3moe always renormalizes, qwen2moe never): written
        # so that a checkpoint whose norm_topk_prob differs runs as trained in fleetllm
        w.add_expert_weights_norm(bool(config.get("norm_topk_prob")))
        if config.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    window = config.get("sliding_window")
    uses_window = config.get("use_sliding_window", arch == gguf.MODEL_ARCH.LLAMA)
    if isinstance(window, int) and window > 0 and uses_window:
        w.add_sliding_window(window)
    rope = _rope(config)
    if (theta := rope.get("rope_theta")) is not None:
        w.add_rope_freq_base(float(theta))
    kind, factor = rope["rope_type"], rope.get("factor")
    if kind in ("default", "llama3"):
        return  # llama3: the rope_freqs tensor
    if kind == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
                         ("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(rope[key])
    else:
        raise ConfigurationError(f"{hf}: rope scaling {kind!r} (factor {factor}) cannot be "
                                 "written to GGUF; supported: linear, yarn, llama3")
