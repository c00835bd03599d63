"""Hugging Face checkpoint -> an AWQ, GPTQ or compressed-tensors checkpoint, by round-to-nearest
(`fleetllm quantize HF_DIR OUT_DIR --type AWQ|GPTQ|W4A16|W8A8`): the formats' tensors and
quantization_config exactly as AutoAWQ, GPTQModel and llm-compressor write them (the layouts:
quant/hf_checkpoint.py), so tests and benchmarks can make them from any checkpoint or preset.
The weights are rounded to their grid, not calibrated (no activation-aware scaling, no Hessian
updates): the files are the real formats, not the real methods' accuracy. GPTQ's act-order
(`act_order=True`) orders columns by their weights' norm, standing in for the Hessian's
diagonal, so that g_idx is unsorted as a real desc_act checkpoint's.

Every decoder projection is quantized, except one whose columns do not divide into whole
groups (the demo model's 688-column down_proj; named in the config's exclusions, as GGUF keeps
such a tensor F16); the embeddings, norms and LM head stay as they are. The
directory gets config.json (with quantization_config), the tokenizer and generation config
copied, and one model.safetensors, written beside and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fleetllm.errors import ConfigurationError
from fleetllm.quant.hf_checkpoint import AWQ_ORDER

FORMATS = ("AWQ", "GPTQ", "W4A16", "W8A8")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_COPIED = (".json", ".txt", ".model", ".jinja", ".tiktoken")


def export_quantized(hf_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                     fmt: str = "AWQ", *, bits: int = 4, group_size: int = 128,
                     sym: bool | None = None, act_order: bool = False) -> Path:
    """Write hf_dir's checkpoint quantized in `fmt` (FORMATS) to out_dir; returns it. bits: 4
    or 8 (GPTQ; W8A8 is 8, AWQ and W4A16 4); group_size: a multiple of 32, or -1 per channel;
    sym: symmetric weights (default: AWQ no, the others yes)."""
    fmt = fmt.upper()
    if fmt not in FORMATS:
        raise ConfigurationError(f"format {fmt!r}: one of {', '.join(FORMATS)}")
    bits = {"AWQ": 4, "W4A16": 4, "W8A8": 8}.get(fmt, bits)
    sym = (fmt != "AWQ") if sym is None else sym
    if fmt == "W8A8":
        group_size = -1
    if bits not in (4, 8) or (fmt == "W8A8" and not sym) or (fmt == "AWQ" and sym) or (
            group_size != -1 and (group_size <= 0 or group_size % 32)):
        raise ConfigurationError(f"{fmt}: bits {bits}, group size {group_size}, sym {sym} is "
                                 "not a combination fleetllm writes")
    hf, out = Path(hf_dir), Path(out_dir)
    config = json.loads((hf / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    orders: dict[str, np.ndarray] = {}  # act-order: one column order per input
    kept: list[str] = []  # projections left unquantized
    for f in sorted(hf.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                prefix, _, last = name.rpartition(".")
                k = t.shape[-1]
                if last == "weight" and prefix.rsplit(".", 1)[-1] in _PROJECTIONS and (
                        k % 32 or (group_size != -1 and k % group_size)):
                    kept.append(prefix)  # no whole groups: stays as it is (GGUF keeps F16)
                    tensors[name] = t
                elif last == "weight" and prefix.rsplit(".", 1)[-1] in _PROJECTIONS:
                    w = t.float().numpy()
                    order = None
                    if act_order:  # the projections that share an input share its order
                        key = prefix.replace("k_proj", "q_proj").replace("v_proj", "q_proj") \
                            .replace("up_proj", "gate_proj")
                        order = orders.setdefault(key, np.argsort(-np.abs(w).sum(0),
                                                                  kind="stable"))
                    tensors.update(_quantize(prefix, w, fmt, bits, group_size, sym, order))
                else:
                    tensors[name] = t
    if not tensors:
        raise ConfigurationError(f"{hf} has no *.safetensors weights")
    config["quantization_config"] = _config(fmt, bits, group_size, sym, act_order, kept)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in hf.iterdir():
            if f.is_file() and f.name.endswith(_COPIED) and not f.name.startswith(
                    "model.safetensors"):
                shutil.copyfile(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _grid(w: np.ndarray, g: np.ndarray, groups: int, bits: int, sym: bool, lowest_zero: int
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round w [N, K] to per-(row, group) grids: unsigned levels q [N, K], scales [G, N]
    (fp16-representable, as stored), zeros [G, N] (at least lowest_zero)."""
    n, k = w.shape
    top = (1 << bits) - 1
    lo = np.full((groups, n), np.inf, np.float32)
    hi = np.full((groups, n), -np.inf, np.float32)
    np.minimum.at(lo, g, w.T)
    np.maximum.at(hi, g, w.T)
    lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
    if sym:  # GPTQ's: the grid spans [-amax, amax], zero in the middle
        amax = np.maximum(-lo, hi)
        s, z = 2 * amax / top, np.full((groups, n), (top + 1) // 2, np.int32)
    else:
        s = (hi - lo) / top
        z = np.clip(np.round(-lo / np.where(s > 0, s, 1)), lowest_zero, top).astype(np.int32)
    s = np.where(s > 0, s, 1e-8).astype(np.float16).astype(np.float32)
    q = np.clip(np.round(w / s[g].T) + z[g].T, 0, top).astype(np.uint8)
    return q, s, z


def _pack(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Inverse of hf_checkpoint.unpack: values along axis into int32 words."""
    v = values.astype(np.uint32)
    per = 32 // bits
    if axis == 0:
        v = v.reshape(-1, per, v.shape[1]) << (np.arange(per, dtype=np.uint32)[None, :, None]
                                               * bits)
        return np.bitwise_or.reduce(v, axis=1).view(np.int32)
    v = v.reshape(v.shape[0], -1, per) << (np.arange(per, dtype=np.uint32) * bits)
    return np.bitwise_or.reduce(v, axis=2).view(np.int32)


def _quantize(prefix: str, w: np.ndarray, fmt: str, bits: int, group_size: int, sym: bool,
              order: np.ndarray | None) -> dict[str, torch.Tensor]:
    """The format's tensors for projection `prefix`; order: act-order's column order (None:
    groups of consecutive columns)."""
    n, k = w.shape
    size = k if group_size == -1 else group_size
    if k % size or k % 32:
        raise ConfigurationError(f"{prefix}: {k} columns do not divide into groups of {size}")
    act_order = order is not None
    g = np.empty(k, np.int64)
    g[np.arange(k) if order is None else order] = np.arange(k) // size
    # GPTQ's format "gptq" stores zero - 1: a zero of 0 has no stored form
    q, s, z = _grid(w, g, k // size, bits, sym, 1 if fmt == "GPTQ" else 0)
    t = torch.from_numpy
    if fmt == "AWQ":  # [K, N] packed along N in AWQ's order
        def awq(v: np.ndarray) -> np.ndarray:
            inverse = np.argsort(AWQ_ORDER)
            return _pack(v.reshape(v.shape[0], -1, 8)[..., inverse].reshape(v.shape), 4, 1)
        return {f"{prefix}.qweight": t(awq(q.T.copy())), f"{prefix}.qzeros": t(awq(z)),
                f"{prefix}.scales": t(s.astype(np.float16))}
    if fmt == "GPTQ":  # format "gptq": each zero stored minus one
        out = {f"{prefix}.qweight": t(_pack(q.T.copy(), bits, 0)),
               f"{prefix}.qzeros": t(_pack((z - 1) & ((1 << bits) - 1), bits, 1)),
               f"{prefix}.scales": t(s.astype(np.float16)),
               f"{prefix}.g_idx": t(g.astype(np.int32))}
        return out
    scale = t(s.T.copy()).to(torch.bfloat16)
    if fmt == "W8A8":  # int8 weights, signed
        return {f"{prefix}.weight": t((q.astype(np.int16) - 128).astype(np.int8)),
                f"{prefix}.weight_scale": scale}
    out = {f"{prefix}.weight_packed": t(_pack(q, bits, 1)), f"{prefix}.weight_scale": scale,
           f"{prefix}.weight_shape": torch.tensor([n, k])}
    if not sym:
        out[f"{prefix}.weight_zero_point"] = t(_pack(z.T.copy(), bits, 0))
    if act_order:
        out[f"{prefix}.weight_g_idx"] = t(g.astype(np.int32))
    return out


def _config(fmt: str, bits: int, group_size: int, sym: bool, act_order: bool,
            kept: list[str]) -> dict[str, Any]:
    """quantization_config; kept: the projections left unquantized (AWQ's
    modules_to_not_convert, compressed-tensors' ignore, GPTQModel's dynamic exclusions)."""
    if fmt == "AWQ":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size,
                "zero_point": True, "version": "gemm", "modules_to_not_convert": kept or None}
    if fmt == "GPTQ":
        out = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
               "desc_act": act_order, "sym": sym, "checkpoint_format": "gptq",
               "static_groups": False, "true_sequential": True, "damp_percent": 0.01}
        if kept:
            out["dynamic"] = {f"-:{p.replace('.', '[.]')}$": {} for p in kept}
        return out
    w8 = fmt == "W8A8"
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size,
               "actorder": "group" if act_order else None, "observer": "minmax"}
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
            "strategy": "token", "observer": None} if w8 else None
    fmt_name = "int-quantized" if w8 else "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt_name,
            "quantization_status": "compressed", "ignore": ["lm_head", *kept],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts,
                                          "output_activations": None, "format": fmt_name}}}
