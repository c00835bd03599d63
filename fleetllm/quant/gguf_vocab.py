"""The tokenizer.ggml.* metadata of a GGUF export, from a Hugging Face tokenizer directory.

What: add_tokenizer(writer, hf_dir, n_vocab) writes the vocabulary the way llama.cpp's
convert_hf_to_gguf.py does: tokenizer.ggml.model, .pre, .tokens, .token_type (and .scores for
"llama"), .merges, the bos/eos/unk/pad ids, add_bos_token / add_eos_token and chat_template.
How: tokenizer.json decides the model. Byte-level BPE (GPT-2, Llama 3, Qwen) is "gpt2": token
strings as the HF tokenizer spells them, ids the tokenizer lacks up to the model's vocab size
padded as [PAD<i>] (UNUSED), added tokens CONTROL when special (or <|...|>-looking), else
USER_DEFINED; the pre-tokenizer name comes from tokenizer.json's split regex (gpt-2,
llama-bpe, qwen2; anything else "default", with a warning). BPE with byte_fallback (the HF
form of Llama 2 / Mistral SentencePiece vocabularies) is "llama" through gguf.LlamaHfVocab,
scored by merge order.
gguf.SpecialVocab adds merges, special ids, add_*_token flags and the chat template; when the
files do not say whether BOS/EOS are added, the flag is read from what the tokenizer does.
Failures: no tokenizer.json (a tokenizer.model alone needs sentencepiece, not installed) or a
tokenizer model other than BPE raises ConfigurationError naming the directory and the model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import gguf

from fleetllm.errors import ConfigurationError

logger = logging.getLogger(__name__)

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_BY_SPLIT = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}


def add_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, n_vocab: int) -> str:
    """Write the tokenizer metadata of `hf_dir` for a model with `n_vocab` embedding rows;
    returns the tokenizer.ggml.model written ("gpt2" or "llama")."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        extra = " (a tokenizer.model alone needs sentencepiece)" if (
            hf_dir / "tokenizer.model").is_file() else ""
        raise ConfigurationError(f"{hf_dir} has no tokenizer.json{extra}: GGUF export needs "
                                 "a Hugging Face fast tokenizer")
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ConfigurationError(f"{path}: tokenizer model {model.get('type')!r} cannot be "
                                 "exported to GGUF (BPE only: byte-level or byte-fallback)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    if model.get("byte_fallback"):
        kind, tokens, toktypes = "llama", *_llama_vocab(writer, hf_dir, n_vocab, model)
        writer.add_tokenizer_pre("default")
    else:
        kind = "gpt2"
        tokens, toktypes = _byte_level_vocab(tokenizer, n_vocab)
        writer.add_tokenizer_pre(_pre_name(spec))
    writer.add_tokenizer_model(kind)
    if len(tokens) != n_vocab:
        raise ConfigurationError(f"{hf_dir}: the tokenizer has {len(tokens)} tokens but the "
                                 f"model's embeddings have {n_vocab} rows")
    writer.add_token_list(tokens)
    writer.add_token_types(toktypes)
    special = gguf.SpecialVocab(hf_dir, load_merges=kind == "gpt2", n_vocab=len(tokens))
    _infer_add_flags(special, tokenizer)
    special.add_to_gguf(writer, quiet=True)
    return kind


def _pre_name(spec: dict[str, Any]) -> str:
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    splits = [p.get("pattern", {}).get("Regex") for p in parts if p.get("type") == "Split"]
    for regex in splits:
        if regex in _PRE_BY_SPLIT:
            return _PRE_BY_SPLIT[regex]
    if not splits and any(p.get("type") == "ByteLevel" and p.get("use_regex", True)
                          for p in parts):
        return "gpt-2"
    logger.warning("GGUF export: pre-tokenizer %s is not one llama.cpp is known to name; "
                   "writing tokenizer.ggml.pre = 'default'", json.dumps(pre)[:200])
    return "default"


def _looks_special(token: str) -> bool:
    return (token.startswith("<|") and token.endswith("|>")) or token in ("<pad>", "<mask>")


def _byte_level_vocab(tokenizer: Any, n_vocab: int) -> tuple[list[str], list[int]]:
    vocab = tokenizer.get_vocab()
    if vocab and max(vocab.values()) >= n_vocab:
        raise ConfigurationError(f"the tokenizer has token id {max(vocab.values())}, beyond "
                                 f"the model's {n_vocab} embedding rows")
    reverse = {i: t for t, i in vocab.items()}
    added = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_vocab):
        token = reverse.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            special = added[i].special or _looks_special(token)
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _llama_vocab(writer: gguf.GGUFWriter, hf_dir: Path, n_vocab: int,
                 model: dict[str, Any]) -> tuple[list[bytes], list[int]]:
    """Tokens and types as LlamaHfVocab reads them. Its scores are all -1000, which leaves
    llama.cpp's SentencePiece tokenizer (it merges the best-scored pair first) no order: a
    token made by BPE merge r scores -r instead, the order the merges are applied in."""
    try:
        vocab = gguf.LlamaHfVocab(hf_dir)
    except (FileNotFoundError, TypeError) as e:
        raise ConfigurationError(f"{hf_dir}: byte-fallback BPE tokenizer not readable as a "
                                 f"llama vocabulary: {e}") from e
    rank: dict[bytes, int] = {}
    for r, merge in enumerate(model.get("merges") or []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault((left + right).encode(), r)
    tokens, scores, types = [], [], []
    for text, score, toktype in vocab.all_tokens():
        tokens.append(text)
        scores.append(-float(rank[text]) if text in rank else score)
        types.append(int(toktype))
    for i in range(len(tokens), n_vocab):  # embedding rows past the tokenizer's ids
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    writer.add_token_scores(scores)
    return tokens, types


def _infer_add_flags(special: gguf.SpecialVocab, tokenizer: Any) -> None:
    """add_bos_token / add_eos_token from what the tokenizer does, where no file says."""
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    for typ, position in (("bos", 0), ("eos", -1)):
        tid = special.special_token_ids.get(typ)
        if typ in special.add_special_token or tid is None:
            continue
        added = len(with_special) > len(plain) and with_special[position] == tid
        special.add_special_token[typ] = bool(added)
