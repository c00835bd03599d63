"""The checkpoint's side of the configuration: ArchConfig (what the model needs of its
config.json, normalized across transformers versions) and ModelConfig (the model, its dtype,
length and task: generate, or embed with its pooler).

ModelConfig reads the checkpoint directory when built: a missing directory, a config.json
that is absent, not JSON or lacks a field, or an unsupported architecture is a
ModelLoadError; a bad setting is a ConfigurationError naming the field. fleetllm.config
re-exports everything here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fleetllm.config_pooler import PoolerConfig, checkpoint_pooler, is_sentence_transformers
from fleetllm.config_quant import ALIASES, METHODS, QuantConfig, resolve
from fleetllm.errors import ConfigurationError, InvalidRequestError, ModelLoadError
from fleetllm.utils import check_field_types
from fleetllm.utils import check_setting as _check

_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
# XForCausalLM generates; the bare XModel (an embedding checkpoint: e5-mistral, gte-Qwen2,
# Qwen3-Embedding) has no LM head and pools (task "embed").
# Mixtures of experts (model/moe.py): generation only, bf16/float32 safetensors.
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
SUPPORTED_ARCHITECTURES = tuple(f"{f}{kind}" for kind in ("ForCausalLM", "Model")
                                for f in _FAMILIES) + MOE_ARCHITECTURES
TASKS = ("auto", "generate", "embed", "embedding")  # "embedding": vLLM's older name
RUNNERS = ("auto", "generate", "pooling")  # vLLM v1's name for the same choice
DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ArchConfig:
    """The parts of a checkpoint's config.json the model needs, normalized across HF versions."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2, or Llama's attention_bias
    o_bias: bool  # Llama's attention_bias also covers o_proj
    mlp_bias: bool
    qk_norm: bool  # Qwen3
    sliding_window: int | None
    eos_token_ids: list[int]
    bos_token_id: int | None
    torch_dtype: str | None
    # Matryoshka embeddings: the truncations the model was trained for (PoolingParams.dimensions)
    matryoshka_dimensions: list[int] | None = None
    is_matryoshka: bool = False
    # Mixture of experts (0 experts: a dense model): each MoE layer routes a token to
    # experts_per_token of num_experts experts (softmax top-k; renormalized when
    # norm_topk_prob), each an MLP of moe_intermediate_size; Qwen2-MoE adds a shared expert
    # (shared_expert_intermediate_size) behind a sigmoid gate. moe_layers: which layers.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ArchConfig:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"architecture {arch!r} is not supported; fleetllm runs "
                                 f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        family = arch.removesuffix("ForCausalLM").removesuffix("Model").removesuffix("Moe")
        # transformers 5 moved rope_theta/rope_scaling into rope_parameters.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        bias = bool(cfg.get("attention_bias") or False)
        window = cfg.get("sliding_window")
        if family.startswith("Qwen") and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "Qwen2" or bias,
            o_bias=bias and family != "Qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "Qwen3",
            sliding_window=window,
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            matryoshka_dimensions=cfg.get("matryoshka_dimensions"),
            is_matryoshka=bool(cfg.get("is_matryoshka", False)),
            **(_moe_fields(arch, cfg) if arch in MOE_ARCHITECTURES else {}),
        )

    @property
    def has_lm_head(self) -> bool:
        return self.architecture.endswith("ForCausalLM")


# Router settings of other MoE families (DeepSeek's grouped top-k, sigmoid scoring, a
# bias on the router's scores), refused rather than silently routed by plain softmax top-k.
_UNSUPPORTED_ROUTER = {
    "n_group": "grouped top-k", "topk_group": "grouped top-k", "topk_method": "top-k method",
    "scoring_func": "router scoring function", "e_score_correction_bias": "router score bias",
    "router_bias": "router bias", "moe_router_bias": "router bias",
    "routed_scaling_factor": "routed scaling factor"}
_HARMLESS = {"topk_method": ("greedy",), "scoring_func": ("softmax",), "n_group": (1,),
             "topk_group": (1,), "routed_scaling_factor": (1, 1.0)}


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ArchConfig's mixture-of-experts fields from an MoE checkpoint's config.json, as
    transformers reads them; a router this engine does not compute: ModelLoadError naming
    the field."""
    for key, what in _UNSUPPORTED_ROUTER.items():
        value = cfg.get(key)
        if value not in (None, False) and value not in _HARMLESS.get(key, ()):
            raise ModelLoadError(f"{arch}: {what} ({key}={value!r}) is not supported; fleetllm "
                                 "routes by softmax top-k only")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{arch}: hidden_act={cfg['hidden_act']!r} is not supported "
                             "(silu is)")
    num_layers = cfg["num_hidden_layers"]
    if arch == "MixtralForCausalLM":  # every layer sparse, top-k always renormalized
        experts, size, layers = cfg["num_local_experts"], cfg["intermediate_size"], \
            tuple(range(num_layers))
        renormalize, shared = True, 0
    else:  # Qwen: dense layers by mlp_only_layers and decoder_sparse_step
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        size, renormalize = cfg["moe_intermediate_size"], bool(cfg.get("norm_topk_prob"))
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(num_layers)
                       if i not in dense and experts > 0 and (i + 1) % step == 0)
        shared = cfg.get("shared_expert_intermediate_size", 0) if "Qwen2" in arch else 0
    top_k = cfg["num_experts_per_tok"]
    if not 0 < top_k <= experts:
        raise ModelLoadError(f"{arch}: num_experts_per_tok={top_k} is not in 1..{experts}")
    return dict(num_experts=experts, experts_per_token=top_k, moe_intermediate_size=size,
                norm_topk_prob=renormalize, shared_expert_intermediate_size=shared,
                moe_layers=layers)


def hf_tensor_shapes(a: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a full (unsharded) Hugging Face checkpoint of this architecture, by
    its checkpoint name."""
    d, hid = a.head_dim, a.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab_size, hid)}
    for i in range(a.num_layers):
        pre = f"model.layers.{i}."
        for name, rows in (("q", a.num_heads * d), ("k", a.num_kv_heads * d),
                           ("v", a.num_kv_heads * d)):
            shapes[f"{pre}self_attn.{name}_proj.weight"] = (rows, hid)
            if a.qkv_bias:
                shapes[f"{pre}self_attn.{name}_proj.bias"] = (rows,)
        shapes[f"{pre}self_attn.o_proj.weight"] = (hid, a.num_heads * d)
        if a.o_bias:
            shapes[f"{pre}self_attn.o_proj.bias"] = (hid,)
        if a.qk_norm:
            shapes[f"{pre}self_attn.q_norm.weight"] = shapes[f"{pre}self_attn.k_norm.weight"] = (d,)
        if i in a.moe_layers:
            shapes.update(_moe_tensor_shapes(a, pre))
        for name, shape in (("gate", (a.intermediate_size, hid)),
                            ("up", (a.intermediate_size, hid)),
                            ("down", (hid, a.intermediate_size))):
            if i in a.moe_layers:
                break
            shapes[f"{pre}mlp.{name}_proj.weight"] = shape
            if a.mlp_bias:
                shapes[f"{pre}mlp.{name}_proj.bias"] = (shape[0],)
        shapes[f"{pre}input_layernorm.weight"] = shapes[f"{pre}post_attention_layernorm.weight"] \
            = (hid,)
    shapes["model.norm.weight"] = (hid,)
    if not a.tie_word_embeddings:
        shapes["lm_head.weight"] = (a.vocab_size, hid)
    return shapes


def _moe_tensor_shapes(a: ArchConfig, pre: str) -> dict[str, tuple[int, ...]]:
    """One MoE layer's router, experts and shared expert, by checkpoint name."""
    hid, inter = a.hidden_size, a.moe_intermediate_size
    mixtral = a.architecture == "MixtralForCausalLM"
    block = f"{pre}block_sparse_moe." if mixtral else f"{pre}mlp."
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    shapes = {f"{block}gate.weight": (a.num_experts, hid)}
    for e in range(a.num_experts):
        for name, shape in zip(names, ((inter, hid), (inter, hid), (hid, inter)), strict=True):
            shapes[f"{block}experts.{e}.{name}.weight"] = shape
    if a.shared_expert_intermediate_size:
        size = a.shared_expert_intermediate_size
        for name, shape in (("gate", (size, hid)), ("up", (size, hid)), ("down", (hid, size))):
            shapes[f"{block}shared_expert.{name}_proj.weight"] = shape
        shapes[f"{block}shared_expert_gate.weight"] = (1, hid)
    return shapes


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError as e:
        raise ModelLoadError(f"{path} not found: is this a Hugging Face checkpoint directory?"
                             ) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}); the checkpoint is corrupt") from e


@dataclass
class ModelConfig:
    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    seed: int = 0
    # "generate", or "embed" (a pooling model: one vector per prompt, model/pooler.py);
    # "auto": embed for a bare XModel or sentence-transformers checkpoint, else generate.
    task: str = "auto"
    runner: str = "auto"  # vLLM v1's name: "pooling" is task "embed"
    # {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool} (or its JSON) over the
    # checkpoint's pooler settings.
    override_pooler_config: dict | str | PoolerConfig | None = None
    # vLLM's: None (what the checkpoint is), "gguf" (model: the path of a .gguf file), or a
    # checkpoint's quantization_config method: "awq", "gptq", "compressed-tensors" (or vLLM's
    # aliases); set to what the checkpoint is (fleetllm/quant/; docs/quantization.md).
    quantization: str | None = None
    arch: ArchConfig = field(init=False, repr=False)
    # A Hugging Face checkpoint's quantization_config, read (config_quant.py); None for others
    quant_config: QuantConfig | None = field(init=False, default=None, repr=False)
    pooler_config: PoolerConfig | None = field(init=False, default=None)  # task "embed" only

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if isinstance(self.tokenizer, os.PathLike):
            self.tokenizer = os.fspath(self.tokenizer)
        check_field_types(self)
        path = Path(self.model)
        cfg = self._read_config(path)
        try:
            self.arch = ArchConfig.from_dict(cfg)
        except KeyError as e:
            raise ModelLoadError(f"{path / 'config.json'} lacks the field {e}") from e
        if self.arch.num_experts and self.quantization not in (None, "gguf"):
            # experts load bf16/float32 or from GGUF files only
            raise ModelLoadError(f"{self.arch.architecture}: quantized experts "
                                 f"({self.quantization}) are not supported; load a bf16 or "
                                 "float32 checkpoint, or a GGUF file")
        if self.is_gguf:  # every tensor's name, shape and bytes, before any worker starts
            from fleetllm.config_gguf import open_gguf
            open_gguf(self.model).check_shapes(hf_tensor_shapes(self.arch))
        self.tokenizer = self.tokenizer or self.model
        limit = self._resolve_task(path)
        if self.arch.sliding_window and self.arch.architecture.startswith("Qwen"):
            # Qwen windows only some layers (max_window_layers), which the model does not
            # follow: stay inside the window, where windowed and full attention agree.
            # (Mistral windows every layer; the attention backend applies it.)
            limit = min(limit, self.arch.sliding_window)
        if self.max_model_len is None:
            self.max_model_len = limit if self.embed_limit is None else \
                min(limit, self.embed_limit)
        _check(isinstance(self.max_model_len, int) and 0 < self.max_model_len <= limit,
               "max_model_len", f"must be in [1, {limit}] for this model, "
               f"got {self.max_model_len!r}")
        _check(isinstance(self.seed, int), "seed", f"must be an int, got {self.seed!r}")
        if isinstance(self.dtype, str) and self.dtype != "auto":
            _check(self.dtype in DTYPES, "dtype",
                   f"must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")

    def _read_config(self, path: Path) -> dict[str, Any]:
        """config.json of a checkpoint directory, or a GGUF file's metadata in its form."""
        from fleetllm.config_gguf import is_gguf, open_gguf

        names = (None, "gguf", *METHODS, *ALIASES)
        _check(self.quantization in names, "quantization",
               f"{self.quantization!r} is not supported (one of "
               f"{', '.join(map(str, names))})")
        if is_gguf(path):
            _check(self.quantization in (None, "gguf"), "quantization",
                   f"{self.model!r} is a GGUF file, not {self.quantization!r}")
            self.quantization = "gguf"
            return open_gguf(str(path)).config
        _check(self.quantization != "gguf", "quantization",
               f"'gguf' needs the path of a .gguf file, got {self.model!r}")
        if not path.is_dir():
            raise ModelLoadError(f"model path {self.model!r} is not a directory (nor a GGUF "
                                 "file); pass a local Hugging Face checkpoint directory or a "
                                 ".gguf file (fleetllm never downloads)")
        cfg = read_json(path / "config.json")
        self.quant_config = resolve(self.quantization, cfg, str(path / "config.json"))
        self.quantization = self.quant_config.method if self.quant_config else None
        return cfg

    @property
    def is_gguf(self) -> bool:
        return self.quantization == "gguf"

    @property
    def quantized(self) -> bool:
        """Weights kept quantized (a GGUF file, or quantization_config): packed copies."""
        return self.quantization is not None

    def _resolve_task(self, path: Path) -> int:
        """Settle task ("generate" | "embed") and the pooler; returns the model's length
        limit. Sets embed_limit: the longest input the checkpoint's embedding library takes
        (sentence-transformers' max_seq_length), the default max_model_len when lower."""
        _check(self.task in TASKS, "task", f"must be one of {', '.join(TASKS)}; got "
               f"{self.task!r}")
        _check(self.runner in RUNNERS, "runner", f"must be one of {', '.join(RUNNERS)}; "
               f"got {self.runner!r}")
        task = {"embedding": "embed"}.get(self.task, self.task)
        if self.runner != "auto":
            implied = "embed" if self.runner == "pooling" else "generate"
            _check(task in ("auto", implied), "runner", f"runner={self.runner!r} contradicts "
                   f"task={self.task!r}")
            task = implied
        if task == "auto":
            bare = not self.arch.has_lm_head or is_sentence_transformers(path)
            task = "embed" if bare else "generate"
        if task == "generate" and not self.arch.has_lm_head:
            raise ConfigurationError(f"task: {self.arch.architecture} has no LM head, so it "
                                     "cannot generate; run it with task='embed'")
        _check(task == "embed" or self.override_pooler_config is None,
               "override_pooler_config", "applies to task='embed' only")
        self.task = task
        self.embed_limit = None
        if task == "embed":
            base, self.embed_limit = checkpoint_pooler(path)
            self.pooler_config = base if self.override_pooler_config is None else \
                PoolerConfig.from_override(self.override_pooler_config, base)
        return self.arch.max_position_embeddings

    @property
    def is_pooling(self) -> bool:
        return self.task == "embed"

    def check_dimensions(self, dims: int | None) -> None:
        """A request's Matryoshka truncation (PoolingParams.dimensions): only to a size the
        model was trained for (config.json matryoshka_dimensions, or any with is_matryoshka).
        The engine and the server (which points its 400 at the field) both ask here."""
        arch = self.arch
        if dims is None:
            return
        allowed = arch.matryoshka_dimensions
        if allowed is None and not arch.is_matryoshka:
            raise InvalidRequestError(f"dimensions={dims}: {self.model} does not support "
                                      "Matryoshka truncation (its config.json has no "
                                      "matryoshka_dimensions / is_matryoshka)")
        if (allowed is not None and dims not in allowed) or dims > arch.hidden_size:
            raise InvalidRequestError(f"dimensions={dims}: this model allows "
                                      f"{allowed or f'at most {arch.hidden_size}'}")

    def torch_dtype(self, device: str) -> torch.dtype:
        """"auto": the checkpoint's dtype, except on the CPU for float16 checkpoints (and
        ones that name none), which run in float32: fleetllm's CPU kernels and oneDNN's fast
        matmuls are float32 and bfloat16 ones (float32 holds every float16 value
        exactly)."""
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        stored = DTYPES.get(self.arch.torch_dtype or "")
        if device == "cpu":
            return torch.bfloat16 if stored == torch.bfloat16 else torch.float32
        return stored or torch.bfloat16
