"""A GGUF file's side of the configuration: its metadata as the config.json a Hugging Face
checkpoint would have, its tensors' names and shapes checked against that config, and the
names of the tensors by Hugging Face's naming (config layer: errors only, and the gguf package).

The metadata and tensor infos come from the file's header (config_gguf_reader.py: its arrays,
the tokenizer's, left unread), so that validating a config costs milliseconds and holds
nothing; gguf's GGUFReader (`GgufFile.reader`, memory-mapped) is opened for the loader only
(quant/gguf_checkpoint.py reads the tensors' data). Mixtures of experts (qwen3moe, qwen2moe,
and Mixtral as arch "llama" with llama.expert_count): the expert_* metadata become config.json's
MoE fields, and a 3-D ffn_{gate,up,down}_exps tensor names one checkpoint tensor an expert
(each of shape [rows, cols]). What fails: a missing, truncated or
non-GGUF file, an architecture or tensor type fleetllm does not read, a tensor whose shape does
not match the config or runs past the end of the file: ModelLoadError naming the file and the
tensor, raised when ModelConfig is built, before any worker starts.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import numpy as np

from fleetllm.config_gguf_reader import GgufHeader
from fleetllm.errors import ModelLoadError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM"}
# Whether the top-k routing weights are renormalized when the file does not say
# ({arch}.expert_weights_norm): llama.cpp's qwen3moe always does (transformers' GGUF loader
# sets norm_topk_prob=True to match), its qwen2moe never does.
_NORM_TOPK = {"qwen3moe": True, "qwen2moe": False}
# The ggml types the kernels read (quant/packed.py QType, by name): not QType's zero-point types,
# fleetllm's own ids (200 up), which no GGUF file holds (the header reader refuses them)
READABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
          "ffn_up_shexp": "mlp.shared_expert.up_proj",
          "ffn_down_shexp": "mlp.shared_expert.down_proj",
          "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# The 3-D expert tensors [experts, rows, cols]: each expert's matrix is a checkpoint tensor
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
            "ffn_down_exps": "down_proj"}
# Mixtral (arch "llama" with llama.expert_count): its experts' Hugging Face names, from the
# 3-D tensors or the older files' one tensor an expert (blk.N.ffn_gate.E.weight)
_MIXTRAL = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2",
            "ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}
_OLD_EXPERT = re.compile(r"(ffn_gate|ffn_up|ffn_down)\.(\d+)")
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf(path: str | Path) -> bool:
    """A file (not a directory) whose name ends in .gguf, or that starts with GGUF's magic."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


@functools.lru_cache(maxsize=4)
def open_gguf(path: str) -> GgufFile:
    """The checkpoint at path (one reader per file and process: the mapping is shared)."""
    return GgufFile(path)


class GgufFile:
    """The file's header (metadata, tensor infos) read at once; `reader` for the loader."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.header = GgufHeader(path)
        except (ValueError, OSError) as e:
            # a bad magic or version, a header cut short (truncated), an unknown value or
            # tensor type, a duplicate key or tensor name: the header reader's ValueError
            raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(f"{path}: GGUF architecture {self.arch!r} is not supported; "
                                 f"fleetllm reads {', '.join(ARCHITECTURES)}")
        self.tensor_infos = {t.name: t for t in self.header.tensors}
        for t in self.header.tensors:
            if t.tensor_type.name not in READABLE:
                raise ModelLoadError(
                    f"{path}: tensor {t.name!r} is of type {t.tensor_type.name}, which "
                    f"fleetllm does not read (it reads {', '.join(READABLE)})")

    @functools.cached_property
    def reader(self) -> Any:
        """gguf's GGUFReader over the file's mapping (every field parsed, each tensor's data a
        view): what the loader reads the tensors from. open_gguf.cache_clear() drops it."""
        from gguf import GGUFReader

        try:
            return GGUFReader(self.path, "r")
        except (ValueError, OSError, IndexError, KeyError, TypeError) as e:
            # a file changed since its header was read; its tensors run past the end
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: {e}") from e

    def field(self, key: str, default: Any = None) -> Any:
        """key's value (an array read from the file now), or default."""
        try:
            return self.header.get(key, default)
        except (ValueError, OSError) as e:  # UnicodeDecodeError too
            raise ModelLoadError(f"{self.path}: metadata {key!r} is unreadable: {e}") from e

    @functools.cached_property
    def config(self) -> dict[str, Any]:
        """The config.json a Hugging Face checkpoint of this model would have."""
        a = self.arch

        def need(key: str) -> Any:
            value = self.field(f"{a}.{key}")
            if value is None:
                raise ModelLoadError(f"{self.path}: metadata lacks {a}.{key}")
            return value

        heads = int(need("attention.head_count"))
        hidden = int(need("embedding_length"))
        vocab = self.field(f"{a}.vocab_size")
        if vocab is None:  # the tokens' count, not read
            tokens = self.header.fields.get("tokenizer.ggml.tokens")
            embd = self.tensor_infos.get("token_embd.weight")
            vocab = len(tokens) if tokens is not None else \
                (int(embd.shape[1]) if embd is not None else None)
        if vocab is None:
            raise ModelLoadError(f"{self.path}: no vocabulary size in the metadata")
        cfg: dict[str, Any] = {
            "architectures": [ARCHITECTURES[a]], "model_type": a,
            "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
            "num_key_value_heads": int(self.field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(self.field(f"{a}.attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.field(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.field(f"{a}.context_length", 2048)),
            "vocab_size": int(vocab),
            "tie_word_embeddings": "output.weight" not in self.tensor_infos,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
        }
        window = self.field(f"{a}.attention.sliding_window")
        if window:
            cfg["sliding_window"] = int(window)
        scaling = self.field(f"{a}.rope.scaling.type")
        factor = self.field(f"{a}.rope.scaling.factor")
        if scaling == "linear" and factor:
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
        elif scaling not in (None, "none"):
            raise ModelLoadError(f"{self.path}: rope scaling {scaling!r} is not supported "
                                 "(linear is)")
        if a in _NORM_TOPK:
            cfg.update(self._moe_config(need))
        elif self.mixtral:  # every layer sparse, top-k renormalized; experts of the FFN width
            cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                       num_local_experts=int(need("expert_count")),
                       num_experts_per_tok=int(need("expert_used_count")))
        freqs = self.tensor_infos.get("rope_freqs.weight")
        if freqs is not None:  # llama3's scaling, as llama.cpp applies it: a factor per pair
            cfg["rope_scaling"] = {"rope_type": "freq_factors", "factors": self._floats(freqs)}
        return cfg

    def _moe_config(self, need: Any) -> dict[str, Any]:
        """The MoE fields of config.json (config_model._moe_fields reads them): the layers
        with a router (blk.N.ffn_gate_inp) are sparse, the others dense (Qwen's
        mlp_only_layers)."""
        a, layers = self.arch, int(need("block_count"))
        sparse = {i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in self.tensor_infos}
        cfg = {"num_experts": int(need("expert_count")),
               "num_experts_per_tok": int(need("expert_used_count")),
               "moe_intermediate_size": int(need("expert_feed_forward_length")),
               "norm_topk_prob": bool(self.field(f"{a}.expert_weights_norm", _NORM_TOPK[a])),
               "mlp_only_layers": [i for i in range(layers) if i not in sparse]}
        if a == "qwen2moe":
            cfg["shared_expert_intermediate_size"] = int(
                self.field(f"{a}.expert_shared_feed_forward_length", 0))
        return cfg

    def _floats(self, info: Any) -> list[float]:
        """A small F32 or F16 tensor's values (as gguf's data, made float32)."""
        kind = {"F32": "f4", "F16": "f2"}.get(info.tensor_type.name)
        if kind is None:
            raise ModelLoadError(f"{self.path}: tensor {info.name!r} is of type "
                                 f"{info.tensor_type.name} (F32 or F16 expected)")
        try:
            raw = self.header.read(info)
        except (ValueError, OSError) as e:
            raise ModelLoadError(f"{self.path}: {e}") from e
        order = self.header.byte_order
        return np.frombuffer(raw, order + kind).astype(np.float32).tolist()

    def hf_name(self, name: str, expert: int | None = None) -> str | None:
        """The Hugging Face name of GGUF tensor `name` (None: not one the model has); of a
        3-D expert tensor, its matrix of `expert` (None without one)."""
        base, _, suffix = name.rpartition(".")
        if base.startswith("blk."):
            _, index, kind = base.split(".", 2)
            if self.mixtral:
                return self._mixtral_name(index, kind, suffix, expert)
            if kind in _EXPERTS:
                return None if expert is None else \
                    f"model.layers.{index}.mlp.experts.{expert}.{_EXPERTS[kind]}.{suffix}"
            mapped = _LAYER.get(kind)
            return None if mapped is None else f"model.layers.{index}.{mapped}.{suffix}"
        mapped = _TOP.get(base)
        return None if mapped is None else f"{mapped}.{suffix}"

    @functools.cached_property
    def mixtral(self) -> bool:
        """An arch "llama" file with experts: Mixtral, as llama.cpp writes it."""
        return self.arch == "llama" and bool(self.field("llama.expert_count"))

    @staticmethod
    def _mixtral_name(index: str, kind: str, suffix: str, expert: int | None) -> str | None:
        """A Mixtral layer tensor's Hugging Face name (block_sparse_moe's router and experts)."""
        pre = f"model.layers.{index}.block_sparse_moe"
        if (old := _OLD_EXPERT.fullmatch(kind)) is not None:  # one tensor an expert
            return f"{pre}.experts.{old[2]}.{_MIXTRAL[old[1]]}.{suffix}"
        if kind in _EXPERTS:
            return None if expert is None else \
                f"{pre}.experts.{expert}.{_MIXTRAL[kind]}.{suffix}"
        if kind == "ffn_gate_inp":
            return f"{pre}.gate.{suffix}"
        mapped = _LAYER.get(kind)
        return None if mapped is None or mapped.startswith("mlp.") else \
            f"model.layers.{index}.{mapped}.{suffix}"

    def check_shapes(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Every tensor has the shape the config gives it, every expected tensor is here, and
        the file holds all the bytes its tensors claim (a truncated file fails here)."""
        size = self.header.size
        seen = set()
        for info in self.header.tensors:
            if info.name == "rope_freqs.weight":
                continue
            shape = tuple(int(d) for d in reversed(info.shape))
            if len(shape) == 3:  # one matrix per expert
                names = [self.hf_name(info.name, e) for e in range(shape[0])]
                shape = shape[1:]
            else:
                names = [self.hf_name(info.name)]
                if len(shape) == 1 and names[0] is not None and \
                        names[0].endswith("shared_expert_gate.weight"):
                    shape = (1, *shape)  # stored 1-D [H] (convert_hf_to_gguf squeezes it)
            for name in names:
                if name is None or name not in expected:
                    raise ModelLoadError(f"{self.path}: tensor {info.name!r} has no place in "
                                         f"this {self.arch} model")
                if shape != expected[name]:
                    raise ModelLoadError(f"{self.path}: tensor {info.name!r} has shape "
                                         f"{shape}, the config says {expected[name]}")
            if info.data_offset + info.n_bytes > size:
                raise ModelLoadError(f"{self.path}: tensor {info.name!r} runs past the end of "
                                     "the file (truncated)")
            seen.update(names)
        missing = set(expected) - seen
        if missing:
            raise ModelLoadError(f"{self.path}: lacks {len(missing)} tensors, e.g. "
                                 f"{sorted(missing)[:3]}")

