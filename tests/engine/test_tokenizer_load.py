"""load_tokenizer's fast path (a bare config instead of the model's config class) must give
the tokenizer a plain AutoTokenizer gives: same class, same ids, same special tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fleetllm.engine.tokenizer import light_config, load_tokenizer

DEMOS = Path(__file__).resolve().parents[2] / "fleetllm"
TEXTS = ["Hello world, hello engine!", "  def step(self):\n\tpass  ", "ünïcödé 漢字 🙂", ""]
# Classes a real checkpoint's tokenizer_config.json declares; transformers re-routes some of
# them by model_type (LlamaTokenizer over a byte-level tokenizer.json, for one).
DECLARED = ["PreTrainedTokenizerFast", "LlamaTokenizerFast", "LlamaTokenizer",
            "Qwen2TokenizerFast", "GPT2TokenizerFast", "TokenizersBackend"]


def _plain(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _assert_same(path):
    assert light_config(str(path)) is not None  # the fast path is the one under test
    fast, plain = load_tokenizer(str(path)), _plain(path)
    assert type(fast) is type(plain)
    for text in TEXTS:
        assert fast(text).input_ids == plain(text).input_ids
        assert fast(text, add_special_tokens=False).input_ids == plain(
            text, add_special_tokens=False).input_ids
        ids = plain(text).input_ids
        assert fast.decode(ids) == plain.decode(ids)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                 "model_max_length", "chat_template", "all_special_ids", "name_or_path"):
        assert getattr(fast, attr) == getattr(plain, attr), attr
    assert fast.get_vocab() == plain.get_vocab()


def _with_class(src: Path, dst: Path, declared: str, model_type: str | None = None) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": declared}))
    if model_type is not None:
        model = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**model, "model_type": model_type}))
    return dst


def test_same_tokenizer_on_every_test_checkpoint(tiny_models):
    for path in [*tiny_models.values(), DEMOS / "demo_model", DEMOS / "demo_draft"]:
        _assert_same(path)


@pytest.mark.parametrize("declared", DECLARED)
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "gpt2"])
def test_same_tokenizer_whatever_class_is_declared(tiny_models, tmp_path, declared, model_type):
    _assert_same(_with_class(tiny_models["llama_gqa"], tmp_path / "ckpt", declared, model_type))


def test_fast_path_does_not_build_the_model_config(tiny_models, monkeypatch):
    """Without the fast path AutoTokenizer calls AutoConfig (transformers 5); with it, not."""
    from transformers.models.auto import tokenization_auto

    def refuse(*args, **kwargs):
        raise AssertionError("AutoConfig was loaded")

    monkeypatch.setattr(tokenization_auto.AutoConfig, "from_pretrained", refuse)
    assert load_tokenizer(str(tiny_models["qwen2_bias"])) is not None


def test_anything_else_takes_the_plain_path(tiny_models, tmp_path):
    remote = _with_class(tiny_models["llama_gqa"], tmp_path / "remote", "PreTrainedTokenizerFast")
    cfg = json.loads((remote / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "tok.MyTokenizer"]}
    (remote / "tokenizer_config.json").write_text(json.dumps(cfg))
    undeclared = _with_class(tiny_models["llama_gqa"], tmp_path / "undeclared", "x")
    cfg = json.loads((undeclared / "tokenizer_config.json").read_text())
    del cfg["tokenizer_class"]
    (undeclared / "tokenizer_config.json").write_text(json.dumps(cfg))
    no_config = _with_class(tiny_models["llama_gqa"], tmp_path / "no_config", "x")
    (no_config / "config.json").unlink()
    for path in (remote, undeclared, no_config):
        assert light_config(str(path)) is None
    assert type(load_tokenizer(str(undeclared))) is type(_plain(undeclared))
    assert load_tokenizer(str(tmp_path)) is None  # no tokenizer files at all
