"""GGUF export's tokenizer metadata (fleetllm.quant.gguf_vocab) beyond the byte-level BPE
that test_gguf_export reads back: the "llama" vocabulary of a byte-fallback BPE tokenizer (the
Hugging Face form of SentencePiece ones), read back by transformers, and the pre-tokenizer
names. Tiny tokenizers trained here; nothing is downloaded."""

from __future__ import annotations

import json

import gguf
import pytest
import transformers
from conftest import make_checkpoint
from gguf_helpers import byte_fallback_tokenizer

from fleetllm.errors import ConfigurationError
from fleetllm.quant.gguf_export import export_gguf
from fleetllm.quant.gguf_vocab import _pre_name

TEXTS = ["def fibonacci(n):\n    return n", "Hello,  world! ü 🦙 x",
         "import os\n\nclass A:\n\tpass"]


def test_byte_fallback_bpe_is_a_llama_vocabulary_scored_by_merge_order(tmp_path):
    hf_dir = make_checkpoint(tmp_path / "spm", "LlamaForCausalLM", vocab_size=600,
                             hidden_size=64, intermediate_size=256, num_hidden_layers=1)
    byte_fallback_tokenizer(hf_dir)
    path = export_gguf(hf_dir, tmp_path / "spm.gguf", "F32", progress=False)
    fields = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()
              if k.startswith("tokenizer.")}
    assert fields["tokenizer.ggml.model"] == "llama"
    assert fields["tokenizer.ggml.pre"] == "default"
    assert fields["tokenizer.ggml.add_bos_token"] is True
    assert fields["tokenizer.ggml.bos_token_id"] == 1
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == 600 and tokens[-1] == "[PAD599]"  # the tokenizer has fewer ids
    assert types[tokens.index("<0x0A>")] == gguf.TokenType.BYTE
    assert types[1] == gguf.TokenType.CONTROL and types[-1] == gguf.TokenType.UNUSED
    merges = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["merges"]
    scores = fields["tokenizer.ggml.scores"]
    for rank, (left, right) in enumerate(merges[:50]):
        assert scores[tokens.index(left + right)] == -rank
    want = transformers.AutoTokenizer.from_pretrained(hf_dir)
    got = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        assert got(text).input_ids == want(text).input_ids
        assert got.decode(got(text).input_ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("spec, name", [
    ({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, "gpt-2"),
    ({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": (
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")}},
        {"type": "ByteLevel", "use_regex": False}]}, "llama-bpe"),
    ({"type": "Whitespace"}, "default"),
])
def test_pre_tokenizer_names(spec, name):
    assert _pre_name({"pre_tokenizer": spec}) == name


def test_tokenizers_that_cannot_be_written_are_clear_errors(tmp_path):
    hf_dir = make_checkpoint(tmp_path / "m", "LlamaForCausalLM", num_hidden_layers=1)
    (hf_dir / "tokenizer.json").unlink()
    (hf_dir / "tokenizer.model").write_bytes(b"")
    with pytest.raises(ConfigurationError, match="no tokenizer.json .a tokenizer.model alone"):
        export_gguf(hf_dir, tmp_path / "x.gguf", progress=False)
    assert not (tmp_path / "x.gguf").exists()
