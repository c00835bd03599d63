"""Pooling test helpers: tiny random-weight embedding checkpoints and their references.

Checkpoints: bare `LlamaModel` / `Qwen2Model` (q/k/v bias) / `Qwen3Model` (q/k norm) saved by
transformers (`config.architectures = ["XModel"]`), weights widened as conftest's
make_checkpoint does so that pooled vectors differ clearly between prompts and pooling types
(and the norms' weights too: with weights of 1 a final norm only rescales the last token);
sentence-transformers directories built on them, both as the installed library saves them and
in the older layout most hub checkpoints have (`sentence_transformers.models.*` module types,
`pooling_mode_*` booleans).

References: Hugging Face `AutoModel` in float32, one unpadded prompt at a time (no attention
mask needed), `last_hidden_state` pooled LAST / MEAN / CLS, truncated, normalized; and
`SentenceTransformer(dir).encode`. A reference that cannot load raises (the test fails), it is
never skipped.
"""

from __future__ import annotations

import json
import shutil
from functools import lru_cache
from pathlib import Path

import torch
from conftest import make_tokenizer

COSINE = 0.99999  # the parity bound

_BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
             head_dim=16)


def make_model_checkpoint(path: Path, arch: str, seed: int = 0,
                          extra_config: dict | None = None, **overrides) -> Path:
    """Save a tiny random-weight checkpoint of `arch` (`LlamaModel`, `Qwen2Model`,
    `Qwen3Model`, or an `XForCausalLM`) with a tokenizer; `extra_config` is merged into
    config.json as written (e.g. `matryoshka_dimensions`, which transformers does not know)."""
    import transformers

    family = arch.removesuffix("ForCausalLM").removesuffix("Model")
    config = getattr(transformers, f"{family}Config")(**{**_BASE, **overrides})
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config)
    with torch.no_grad():  # as make_checkpoint: the tiny default init makes all vectors alike
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
            else:  # norm weights of 1 would hide a missing final norm from LAST and CLS
                p.normal_(1, 0.3)
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    if extra_config:
        cfg_path = path / "config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **extra_config},
                                       indent=2))
    make_tokenizer(path, config.vocab_size)
    return path


@lru_cache(maxsize=8)
def _hf_model(path: str):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    return model.eval()


@lru_cache(maxsize=4096)
def _hidden(path: str, token_ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        out = _hf_model(path)(input_ids=torch.tensor([token_ids]))
    return out.last_hidden_state[0].float()


def hf_embedding(path: Path | str, token_ids: list[int], pooling_type: str, normalize: bool,
                 dimensions: int | None = None) -> torch.Tensor:
    """The reference vector: HF AutoModel's last hidden state (after the final norm) pooled,
    then truncated to `dimensions`, then L2-normalized if `normalize`."""
    hidden = _hidden(str(path), tuple(token_ids))
    vector = {"LAST": hidden[-1], "CLS": hidden[0], "MEAN": hidden.mean(dim=0)}[pooling_type]
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
    return vector


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a.dot(b) / (a.norm() * b.norm()))


def assert_same_vector(got: torch.Tensor | list[float], want: torch.Tensor, what: str,
                       normalized: bool | None = None) -> None:
    """Cosine >= COSINE, the same shape and (so that a wrong scale or normalization shows)
    close values; `normalized` also checks the length is / is not 1."""
    got = torch.as_tensor(got, dtype=torch.float32)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert cosine(got, want) >= COSINE, f"{what}: cosine {cosine(got, want):.7f}"
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-5, msg=what)
    if normalized is not None:
        norm = float(got.double().norm())
        assert (abs(norm - 1) < 1e-5) == normalized, f"{what}: norm {norm}"


# ------------------------------------------------------------------ sentence-transformers

ST_MODES = {"LAST": "lasttoken", "MEAN": "mean", "CLS": "cls"}


def make_st_checkpoint(base: Path, out: Path, pooling_type: str, normalize: bool,
                       dense: bool = False) -> Path:
    """A sentence-transformers directory over checkpoint `base`, saved by the installed
    library (Transformer at the root, 1_Pooling, 2_Normalize or 2_Dense)."""
    from sentence_transformers import SentenceTransformer
    try:  # 6.x moved the modules (the old import path warns)
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:
        from sentence_transformers import models

    transformer = models.Transformer(str(base))
    dim = (getattr(transformer, "get_embedding_dimension", None)  # 6.x; older: word_...
           or transformer.get_word_embedding_dimension)()
    modules = [transformer, models.Pooling(dim, pooling_mode=ST_MODES[pooling_type])]
    if dense:
        modules.append(models.Dense(dim, 8))
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


def make_legacy_st_checkpoint(base: Path, out: Path, pooling_type: str,
                              normalize: bool) -> Path:
    """The layout of hub checkpoints written by sentence-transformers 2.x/3.x (gte-Qwen2,
    e5-mistral, Qwen3-Embedding): `sentence_transformers.models.*` types, a Pooling config of
    `pooling_mode_*` booleans. Built by hand: the installed library saves its own layout."""
    shutil.copytree(base, out)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir()
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir()
    hidden = json.loads((base / "config.json").read_text())["hidden_size"]
    flags = {f"pooling_mode_{m}": False for m in ("cls_token", "mean_tokens", "max_tokens",
                                                   "mean_sqrt_len_tokens",
                                                   "weightedmean_tokens", "lasttoken")}
    flags[{"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens",
           "CLS": "pooling_mode_cls_token"}[pooling_type]] = True
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, **flags, "include_prompt": True}, indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": 512, "do_lower_case": False}))
    return out


def st_encode(path: Path, texts: list[str]) -> torch.Tensor:
    """What `SentenceTransformer(path).encode(texts)` gives, float32 [len(texts), dim]."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu", local_files_only=True)
    return torch.as_tensor(model.encode(texts, convert_to_numpy=True, batch_size=4))
