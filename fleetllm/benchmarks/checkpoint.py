"""A preset's dummy weights written as a real checkpoint (config.json + safetensors), for peers
that only load from disk (vLLM): the same tensors fleetllm's load_format="dummy" makes and
hf_peers hands to transformers, a function of (seed, checkpoint tensor name), so every engine
computes the same function."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from fleetllm.config import ArchConfig, read_json
from fleetllm.model.loader import dummy_tensor, hf_tensor_shapes

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def write_dummy_checkpoint(config_dir: str | Path, out_dir: str | Path, seed: int,
                           dtype: torch.dtype, shard_bytes: int = 1 << 30) -> Path:
    """config_dir's config.json (torch_dtype set to `dtype`) and its dummy weights for `seed`
    in `dtype`, in out_dir. Shards of at most shard_bytes (plus an index when more than one),
    so a 1B model never holds more than one shard in memory while writing."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} cannot be written; one of {list(DTYPE_NAMES)}")
    raw = read_json(Path(config_dir) / "config.json")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = [[]]
    size = 0
    shapes = hf_tensor_shapes(ArchConfig.from_dict(raw))
    for name, shape in shapes.items():
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for names, file in zip(shards, files, strict=True):
        # Rounded from the float32 draw exactly as loading the dummy weights into a model
        # of this dtype rounds them (a copy_ into the parameter).
        tensors = {n: dummy_tensor(n, shapes[n], seed).to(dtype).contiguous() for n in names}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
    if len(files) > 1:
        total = sum(torch.Size(s).numel() for s in shapes.values()) * dtype.itemsize
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for names, f in zip(shards, files, strict=True)
                                for n in names}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps({**raw, "torch_dtype": DTYPE_NAMES[dtype]},
                                                indent=1))
    return out


def write_word_tokenizer(out_dir: str | Path, vocab_size: int) -> Path:
    """A tokenizer for a dummy checkpoint that has none: one word per token id ("w123"),
    split on whitespace, so every id decodes to text that encodes back to the same id (a
    serving benchmark's random prompts survive the round trip through text). Ids 0-2 are
    <unk>, <s>, </s>, as in the presets' configs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
        "model_max_length": 1 << 20}, indent=1))
    return out


def write_byte_bpe_tokenizer(out_dir: str | Path, vocab_size: int) -> Path:
    """A placeholder byte-level BPE tokenizer of vocab_size ids for a dummy checkpoint that is
    written as a GGUF (`fleetllm quantize --preset`): GGUF files carry a BPE vocabulary (with
    merges, which llama.cpp requires), not a word-level one. Ids 0-2 are <unk>, <s>, </s>,
    then the 256 byte symbols, then filler tokens no text produces."""
    # GPT-2's byte -> printable symbol table
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    symbols = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>", *symbols, "\u0120w"]
    tokens += [f"\u0120w{i}" for i in range(vocab_size - len(tokens))]
    spec = {"version": "1.0", "truncation": None, "padding": None, "normalizer": None,
            "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}
                             for i, t in enumerate(tokens[:3])],
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                              "trim_offsets": True, "use_regex": True},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                        "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {t: i for i, t in enumerate(tokens)},
                      "merges": ["\u0120 w"]}}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(spec))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}, indent=1))
    return out
