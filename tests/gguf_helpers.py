"""Tiny Hugging Face checkpoints for the GGUF export tests (tests/quant), and reading a .gguf
back: with transformers' own GGUF loader, or with llama.cpp's tools where `make llamacpp` built
them (.peers/llama.cpp/build/bin, or $FLEETLLM_LLAMACPP_BIN)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import _CORPUS, make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "fleetllm" / "demo_model"
LLAMACPP_BIN = Path(os.environ.get("FLEETLLM_LLAMACPP_BIN",
                                   ROOT / ".peers" / "llama.cpp" / "build" / "bin"))
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SIZES = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=512, bos_token_id=0, eos_token_id=0)
MODELS = {  # name: (architecture, overrides)
    "llama": ("LlamaForCausalLM", {}),
    "mistral": ("LlamaForCausalLM", {}),  # config.json rewritten as MistralForCausalLM below
    "qwen2": ("Qwen2ForCausalLM", dict(intermediate_size=544)),  # K-quant fallbacks
    # transformers reads no head_dim from a qwen3 GGUF (its default: 128): hidden 512, 4 heads
    "qwen3": ("Qwen3ForCausalLM", dict(tie_word_embeddings=True, rope_theta=50000.0,
                                       hidden_size=512, head_dim=128)),
}


def rel_rms(y: np.ndarray, x: np.ndarray) -> float:
    return float(np.sqrt(((y - x) ** 2).mean() / (x ** 2).mean()))


def llamacpp_tool(name: str) -> Path:
    """A file of the llama.cpp build; skips the test where there is none."""
    path = LLAMACPP_BIN / name
    if not path.is_file():
        pytest.skip(f"no {name} at {LLAMACPP_BIN} (make llamacpp)")
    return path


def demo_tokenizer(path: Path, qwen: bool) -> None:
    """The demo model's tokenizer; for Qwen with Qwen2's split regex (transformers reads a
    qwen2 / qwen3 GGUF's tokenizer with Qwen2's pipeline whatever the file's pre says)."""
    for f in path.glob("*"):
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO / name, path / name)
    if qwen:
        spec = json.loads((path / "tokenizer.json").read_text())
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False}]}
        (path / "tokenizer.json").write_text(json.dumps(spec))


def byte_fallback_tokenizer(path: Path) -> None:
    """Llama 2's tokenizer.json shape: BPE with byte fallback, Metaspace, BOS added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                 split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False, special_tokens=[
        "<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))])
    tok.train_from_iterator(_CORPUS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    for f in path.glob("tokenizer*"):
        f.unlink()
    transformers.LlamaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                    unk_token="<unk>", legacy=False).save_pretrained(path)


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def make_hf_models(root: Path, names: list[str] | None = None) -> dict[str, Path]:
    """MODELS (or those named) saved under root, with the demo model's tokenizer."""
    out = {}
    for i, (name, (arch, overrides)) in enumerate(MODELS.items()):
        if names is not None and name not in names:
            continue
        # general.name is the directory's: transformers reads a file named exactly "mistral"
        # as its own mistral architecture, which its GGUF loader then cannot map
        path = make_checkpoint(root / f"{name}-tiny", arch, seed=i, **{**SIZES, **overrides})
        demo_tokenizer(path, qwen=name.startswith("qwen"))
        out[name] = path
    if "mistral" in out:
        edit_config(out["mistral"], architectures=["MistralForCausalLM"], model_type="mistral",
                    sliding_window=64)
    return out


def load_gguf(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def load_reference(hf_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32).eval()
