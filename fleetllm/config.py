"""Engine configuration: one dataclass per concern, all held by EngineConfig.

`EngineConfig.from_kwargs(model=..., **kwargs)` takes the flat keyword names vLLM users know
(tensor_parallel_size, block_size, max_num_seqs, dtype, ...). Every value is validated here, so
a bad setting fails before any process starts, with a ConfigurationError naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fleetllm.config_lora import LoRAConfig
from fleetllm.config_pooler import PoolerConfig, checkpoint_pooler, is_sentence_transformers
from fleetllm.config_speculative import SpeculativeConfig
from fleetllm.errors import ConfigurationError, InvalidRequestError, ModelLoadError
from fleetllm.utils import check_field_types

# The grammar backends (fleetllm/structured_outputs/backends.py) a DecodingConfig may name.
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")
_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
# XForCausalLM generates; the bare XModel (an embedding checkpoint: e5-mistral, gte-Qwen2,
# Qwen3-Embedding) has no LM head and pools (task "embed").
SUPPORTED_ARCHITECTURES = tuple(f"{f}{kind}" for kind in ("ForCausalLM", "Model")
                                for f in _FAMILIES)
TASKS = ("auto", "generate", "embed", "embedding")  # "embedding": vLLM's older name
RUNNERS = ("auto", "generate", "pooling")  # vLLM v1's name for the same choice
_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16}
GiB = 1 << 30
logger = logging.getLogger(__name__)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigurationError(f"{field_name}: {message}")


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

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ArchConfig:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"architecture {arch!r} is not supported; fleetllm runs "
                                 f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        family = arch.removesuffix("ForCausalLM").removesuffix("Model")
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
        )

    @property
    def has_lm_head(self) -> bool:
        return self.architecture.endswith("ForCausalLM")


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
    arch: ArchConfig = field(init=False, repr=False)
    pooler_config: PoolerConfig | None = field(init=False, default=None)  # task "embed" only

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if isinstance(self.tokenizer, os.PathLike):
            self.tokenizer = os.fspath(self.tokenizer)
        check_field_types(self)
        path = Path(self.model)
        if not path.is_dir():
            raise ModelLoadError(f"model path {self.model!r} is not a directory; pass a local "
                                 "Hugging Face checkpoint directory (fleetllm never downloads)")
        cfg = read_json(path / "config.json")
        try:
            self.arch = ArchConfig.from_dict(cfg)
        except KeyError as e:
            raise ModelLoadError(f"{path / 'config.json'} lacks the field {e}") from e
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
            _check(self.dtype in _DTYPES, "dtype",
                   f"must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")

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
            return _DTYPES[self.dtype]
        stored = _DTYPES.get(self.arch.torch_dtype or "")
        if device == "cpu":
            return torch.bfloat16 if stored == torch.bfloat16 else torch.float32
        return stored or torch.bfloat16


@dataclass
class CacheConfig:
    block_size: int = 16
    # CPU: KV cache budget in bytes (> 1) or as a fraction of total RAM (<= 1).
    kv_cache_memory: float | None = None
    gpu_memory_utilization: float = 0.9
    swap_space: int = GiB // 2  # bytes of CPU memory for swapped-out blocks, per worker
    num_gpu_blocks_override: int | None = None
    # Reuse the KV blocks of cached prompt prefixes (core/prefix_cache.py).
    enable_prefix_caching: bool = True
    # The KV cache's dtype: "auto" (the model's), "bfloat16" or "float32".
    kv_cache_dtype: str = "auto"
    num_gpu_blocks: int | None = None  # set once the executor has measured
    num_cpu_blocks: int | None = None

    def __post_init__(self) -> None:
        check_field_types(self)
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
               f"{self.kv_cache_dtype!r} is not supported: one of "
               f"{', '.join(KV_CACHE_DTYPES)} (fleetllm has no quantized, fp8, KV cache)")
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size",
               f"must be a power of two in [1, 128], got {self.block_size!r}")
        if self.kv_cache_memory is not None:
            _check(self.kv_cache_memory > 0, "kv_cache_memory",
                   f"must be > 0 (bytes, or a fraction of RAM <= 1), got {self.kv_cache_memory}")
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
               f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.swap_space >= 0, "swap_space", f"must be >= 0 bytes, got {self.swap_space}")
        _check(self.swap_space == 0 or self.swap_space >= 1 << 20, "swap_space",
               f"is in bytes: {self.swap_space} is less than 1 MiB (for {self.swap_space} GiB "
               f"pass {int(self.swap_space * GiB)})")
        if self.num_gpu_blocks_override is not None:
            _check(self.num_gpu_blocks_override > 0, "num_gpu_blocks_override", "must be > 0")

    def torch_kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.kv_cache_dtype == "auto" else _DTYPES[self.kv_cache_dtype]


KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's names


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "uni" | "mp" | "ray" | an Executor subclass | "module:Class"; None picks uni or mp.
    distributed_executor_backend: Any = None
    worker_cls: str = "fleetllm.worker.worker.Worker"
    # Seconds for worker processes to come up (ray: the placement group's resources too).
    startup_timeout: float = 120.0
    # Seconds one execute_model step may take before the executor gives up on its workers.
    # Enforced by the process-based backends (mp, ray): 'uni' runs the step in this process
    # and cannot interrupt it.
    execute_model_timeout: float = 300.0
    # Times the engine may replace crashed or hung workers and resume every request (0: none;
    # then a crash fails every request, as in vLLM).
    max_worker_restarts: int = 3
    # ... within any window of this many seconds: a restart older than that is forgotten, so
    # a server that runs for weeks is not killed by its 4th unrelated crash in months, while
    # a crash loop still exhausts the limit within seconds (inf: over the engine's life).
    worker_restart_window_s: float = 3600.0
    # The "ray" backend's settings (fleetllm/executor/ray_executor.py, docs/distributed.md);
    # the other backends ignore them, so one command line can compare backends. The Ray cluster to
    # join ("auto", "host:port", "ray://host:port"); None: $RAY_ADDRESS when set, else a private
    # local instance is started, and stopped with the last executor using it.
    ray_address: str | None = None
    # How the placement group (one bundle per worker) is laid out over the nodes.
    placement_strategy: str = "PACK"
    # An existing placement group to run in (a ray PlacementGroup or the name of one): its
    # first world_size bundles hold the workers. None: the executor makes its own.
    placement_group: Any = None
    # CPU workers: logical CPUs each worker's bundle reserves (fractions allowed: 0.5 fits 4
    # workers on 2 CPUs); also its torch thread count, at least 1. CUDA bundles are {GPU: 1}.
    ray_cpus_per_worker: float = 1.0
    world_size: int = field(init=False)

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 1, name, f"must be an int >= 1, got "
                   f"{value!r}")
        self.world_size = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        backend = self.distributed_executor_backend
        _check(isinstance(backend, type) or (isinstance(backend, str) and (
            backend in ("uni", "mp", "ray") or ":" in backend)),
               "distributed_executor_backend",
               "must be 'uni', 'mp', 'ray', an Executor subclass or 'module:Class'; "
               f"got {backend!r}")
        _check(backend != "uni" or self.world_size == 1, "distributed_executor_backend",
               f"'uni' runs one worker; world_size is {self.world_size}: use 'mp' or 'ray'")
        _check("." in self.worker_cls, "worker_cls", f"must be 'module.Class', got "
               f"{self.worker_cls!r}")
        _check(self.startup_timeout > 0, "startup_timeout", "must be > 0 seconds")
        _check(self.max_worker_restarts >= 0, "max_worker_restarts", "must be >= 0")
        _check(self.worker_restart_window_s > 0, "worker_restart_window_s",
               f"must be > 0 seconds (inf: never forgotten), got "
               f"{self.worker_restart_window_s!r}")
        timeout = self.execute_model_timeout
        _check(isinstance(timeout, int | float) and not isinstance(timeout, bool)
               and 0 < timeout < float("inf"), "execute_model_timeout",
               f"must be a finite number of seconds > 0, got {timeout!r}")
        self._check_ray_fields()

    def _check_ray_fields(self) -> None:
        _check(self.ray_address is None or self.ray_address.strip() != "", "ray_address",
               "must be None (RAY_ADDRESS, else a local instance) or an address, got ''")
        _check(self.placement_strategy in PLACEMENT_STRATEGIES, "placement_strategy",
               f"must be one of {', '.join(PLACEMENT_STRATEGIES)}; got "
               f"{self.placement_strategy!r}")
        pg = self.placement_group
        _check(pg is None or (isinstance(pg, str) and pg != "") or hasattr(pg, "bundle_specs"),
               "placement_group", f"must be None, a ray PlacementGroup or the name of one; got "
               f"{pg!r}")
        cpus = self.ray_cpus_per_worker
        _check(0 < cpus < float("inf"), "ray_cpus_per_worker",
               f"must be a finite number of CPUs > 0, got {cpus!r}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    # Tokens computed in one step. Prompts longer than this are prefilled in chunks, so the
    # budget need not grow with max_model_len (the profile run uses this many tokens).
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # copied from ModelConfig
    preemption_mode: str = "recompute"  # or "swap"
    # Multi-step decoding: a decode-only step (nothing waiting) runs this many forward passes
    # in one call to the workers, which sample and feed the tokens back themselves.
    num_scheduler_steps: int = 1
    # KV slots each decoding sequence holds past its next token: speculative decoding's
    # drafts or multi-step's later tokens (0: neither). Set by EngineConfig.
    num_lookahead_slots: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        check_field_types(self)
        _check(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1, "max_num_seqs",
               f"must be an int >= 1, got {self.max_num_seqs!r}")
        _check(self.preemption_mode in ("recompute", "swap"), "preemption_mode",
               f"must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        _check(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
               "max_num_batched_tokens", f"must be an int >= 1, got "
               f"{self.max_num_batched_tokens!r}")
        _check(isinstance(self.num_scheduler_steps, int) and self.num_scheduler_steps >= 1,
               "num_scheduler_steps", f"must be an int >= 1, got {self.num_scheduler_steps!r}")


@dataclass
class DeviceConfig:
    device: str = "auto"

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        _check(self.device in ("cpu", "cuda"), "device", f"must be auto, cpu or cuda; got "
               f"{self.device!r}")
        _check(self.device != "cuda" or torch.cuda.is_available(), "device",
               "cuda was asked for but torch sees no CUDA device")


@dataclass
class LoadConfig:
    load_format: str = "auto"  # auto | safetensors | sharded_state | dummy

    def __post_init__(self) -> None:
        check_field_types(self)
        _check(self.load_format in ("auto", "safetensors", "sharded_state", "dummy"),
               "load_format", f"must be auto, safetensors, sharded_state or dummy; got "
               f"{self.load_format!r}")


@dataclass
class DecodingConfig:
    # Grammar library for structured outputs (fleetllm/structured_outputs/backends.py):
    # auto (xgrammar, guidance for what xgrammar refuses), xgrammar or guidance.
    structured_outputs_backend: str = "auto"

    def __post_init__(self) -> None:
        check_field_types(self)
        _check(self.structured_outputs_backend in STRUCTURED_OUTPUTS_BACKENDS,
               "structured_outputs_backend",
               f"must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}; got "
               f"{self.structured_outputs_backend!r}")


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    load_config: LoadConfig
    lora_config: LoRAConfig | None = None  # set when enable_lora (fleetllm/lora/)
    # Speculative decoding (fleetllm/spec_decode): a dict with vLLM's keys becomes this.
    speculative_config: SpeculativeConfig | None = None
    decoding_config: DecodingConfig = field(default_factory=DecodingConfig)

    def __post_init__(self) -> None:
        m, s, p = self.model_config, self.scheduler_config, self.parallel_config
        s.max_model_len = m.max_model_len
        a, tp, pp = m.arch, p.tensor_parallel_size, p.pipeline_parallel_size
        _check(a.num_heads % tp == 0, "tensor_parallel_size",
               f"{a.num_heads} attention heads are not divisible by tensor_parallel_size={tp}")
        _check(a.num_kv_heads % tp == 0 or tp % a.num_kv_heads == 0, "tensor_parallel_size",
               f"{a.num_kv_heads} KV heads and tensor_parallel_size={tp}: one must divide the "
               "other")
        _check(a.intermediate_size % tp == 0, "tensor_parallel_size",
               f"intermediate_size {a.intermediate_size} is not divisible by {tp}")
        _check(pp <= a.num_layers, "pipeline_parallel_size",
               f"{pp} stages for a model of {a.num_layers} layers: use at most {a.num_layers}")
        _check(self.lora_config is None or not m.is_pooling, "enable_lora",
               "LoRA adapters apply to generating models only (task='generate')")
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        spec = self.speculative_config
        _check(spec is None or not m.is_pooling, "speculative_config",
               "speculative decoding applies to generating models only (task='generate')")
        if spec is not None and spec.method == "draft_model":
            self.speculative_config = spec = _resolve_draft_len(spec, m)
            draft = ModelConfig(model=spec.model, max_model_len=spec.max_model_len).arch
            _check(draft.vocab_size == a.vocab_size, "speculative_config",
                   f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from "
                   f"the target's ({a.vocab_size}): it must share the tokenizer")
        _check(spec is None or s.num_scheduler_steps == 1, "num_scheduler_steps",
               "multi-step decoding and speculative decoding cannot be combined")
        _check(s.num_scheduler_steps == 1 or not m.is_pooling, "num_scheduler_steps",
               "multi-step decoding applies to generating models only")
        # KV slots a decoding sequence holds past its next token: the step's drafts, or the
        # tokens of a multi-step call's later steps.
        s.num_lookahead_slots = spec.num_speculative_tokens if spec is not None else \
            s.num_scheduler_steps - 1

    @classmethod
    def from_kwargs(cls, model: str | os.PathLike, **kwargs: Any) -> EngineConfig:
        """Build a config from flat vLLM-style keyword arguments. vLLM arguments fleetllm
        has no field for are in VLLM_ARGS: ignored with a warning, or refused."""
        parts: dict[type, dict[str, Any]] = {c: {} for c in _SECTIONS}
        section_of = {f.name: section for section, f in engine_arg_fields()}
        extras: dict[str, Any] = {}
        spec_flat: dict[str, Any] = {}  # vLLM's older flat speculative arguments
        for key, value in kwargs.items():
            if key == "pooler_config":  # vLLM's newer name
                key = "override_pooler_config"
            if key == "guided_decoding_backend":  # vLLM's older name
                key = "structured_outputs_backend"
            if key == "structured_outputs_config":  # vLLM's: {"backend": ...}
                value = dict(value or {})
                backend = value.pop("backend", "auto")
                if value:
                    raise ConfigurationError(f"structured_outputs_config: {sorted(value)} "
                                             "are not supported; only 'backend' is")
                key, value = "structured_outputs_backend", backend
            if key in section_of:
                parts[section_of[key]][key] = value
            elif key in ("lora_config", "speculative_config"):
                extras[key] = value
            elif key in SPEC_FLAT_ARGS:
                spec_flat[SPEC_FLAT_ARGS[key]] = value
            elif key in VLLM_ARGS:
                VLLM_ARGS[key].accept(key, value)
            else:
                raise ConfigurationError(f"{key}: unknown engine argument")
        model_config = ModelConfig(model=str(model), **parts[ModelConfig])
        if model_config.is_pooling:
            # A pooling prompt runs in one step (its vector needs every token's hidden state,
            # which no KV cache keeps): the budget holds the longest; nothing is cached.
            parts[SchedulerConfig].setdefault(
                "max_num_batched_tokens", max(2048, model_config.max_model_len))
            parts[CacheConfig].setdefault("enable_prefix_caching", False)
        if "lora_config" in kwargs:  # a LoRAConfig itself (or None), not the flat fields
            if parts[LoRAConfig]:
                raise ConfigurationError("lora_config: pass it or the flat LoRA arguments "
                                         f"({', '.join(parts[LoRAConfig])}), not both")
            lora = kwargs["lora_config"]
            if lora is not None and not isinstance(lora, LoRAConfig):
                raise ConfigurationError(f"lora_config: must be a LoRAConfig, got {lora!r}")
        else:
            lora = LoRAConfig(**parts[LoRAConfig])
            if not lora.enable_lora:  # the other LoRA settings are ignored, as in vLLM
                lora = None
        extras.pop("lora_config", None)
        spec_flat = {k: v for k, v in spec_flat.items() if v is not None}
        if spec_flat:
            if extras.get("speculative_config") is not None:
                raise ConfigurationError(
                    f"speculative_config: pass it or {', '.join(SPEC_FLAT_ARGS)}, not both")
            if "model" not in spec_flat:
                raise ConfigurationError("num_speculative_tokens: needs speculative_model "
                                         "(or speculative_config={...})")
            extras["speculative_config"] = spec_flat
        return cls(
            model_config=model_config,
            lora_config=lora,
            cache_config=CacheConfig(**parts[CacheConfig]),
            parallel_config=ParallelConfig(**parts[ParallelConfig]),
            scheduler_config=SchedulerConfig(**parts[SchedulerConfig]),
            device_config=DeviceConfig(**parts[DeviceConfig]),
            load_config=LoadConfig(**parts[LoadConfig]),
            decoding_config=DecodingConfig(**parts[DecodingConfig]),
            **extras,
        )


@dataclass(frozen=True)
class VllmArg:
    """A vLLM engine argument fleetllm has no field for, accepted so that vLLM scripts and
    command lines run unchanged, or refused with the reason."""

    default: Any  # vLLM's default ("off"); its type is also the CLI flag's
    note: str  # why it is ignored, or why it is not supported
    refuse: bool = False  # True: any value but `default` would change results: an error

    def accept(self, name: str, value: Any) -> None:
        if not self.refuse:
            logger.warning("%s=%r is accepted for vLLM compatibility and ignored: %s", name,
                           value, self.note)
        elif value != self.default:
            raise ConfigurationError(f"{name}: {value!r} is not supported: {self.note}")


def _resolve_draft_len(spec: SpeculativeConfig, target: ModelConfig) -> SpeculativeConfig:
    """The draft model's max_model_len, as vLLM sets it: the draft's own limit, capped at the
    target's (and at speculative_config's max_model_len, which may not exceed either). A
    shorter draft is no error: sequences past its length decode without drafts."""
    try:
        own = ModelConfig(model=spec.model).max_model_len
    except (ConfigurationError, ModelLoadError) as e:  # say which model it is about
        raise type(e)(f"speculative_config: the draft model {spec.model}: "
                      f"{e.args[0] if e.args else e}") from e
    cap = min(own, target.max_model_len)
    asked = spec.max_model_len
    _check(asked is None or asked <= cap, "speculative_config",
           f"max_model_len={asked} exceeds the draft model's ({own}) or the target's "
           f"max_model_len ({target.max_model_len})")
    return dataclasses.replace(spec, max_model_len=cap if asked is None else asked)


# vLLM's older flat speculative arguments -> speculative_config keys.
SPEC_FLAT_ARGS = {"speculative_model": "model",
                  "num_speculative_tokens": "num_speculative_tokens",
                  "ngram_prompt_lookup_max": "prompt_lookup_max",
                  "ngram_prompt_lookup_min": "prompt_lookup_min"}

VLLM_ARGS: dict[str, VllmArg] = {
    # Tuning of machinery fleetllm does not have: the results are the same without it.
    "enforce_eager": VllmArg(False, "fleetllm has no CUDA graphs, it always runs eagerly"),
    "max_seq_len_to_capture": VllmArg(8192, "fleetllm has no CUDA graphs"),
    "max_context_len_to_capture": VllmArg(None, "fleetllm has no CUDA graphs"),
    "disable_custom_all_reduce": VllmArg(False, "fleetllm has no custom all-reduce"),
    "trust_remote_code": VllmArg(False, "fleetllm runs its own model code, never a "
                                        "checkpoint's"),
    "tokenizer_mode": VllmArg("auto", "the checkpoint's tokenizer is loaded with "
                                      "transformers' AutoTokenizer"),
    "disable_log_stats": VllmArg(False, "fleetllm has no stats logger"),
    "disable_log_requests": VllmArg(False, "fleetllm does not log requests"),
    "enable_chunked_prefill": VllmArg(None, "fleetllm always prefills in chunks of "
                                            "max_num_batched_tokens"),
    "use_v2_block_manager": VllmArg(True, "fleetllm has one block manager"),
    "disable_async_output_proc": VllmArg(False, "fleetllm processes outputs in step"),
    "download_dir": VllmArg(None, "fleetllm loads local directories and never downloads"),
    "disable_sliding_window": VllmArg(False, "max_model_len is capped at the sliding "
                                             "window either way"),
    # Features that change the results, which fleetllm does not implement: refused unless
    # they hold vLLM's default, which means what fleetllm does anyway.
    "quantization": VllmArg(None, "fleetllm runs unquantized checkpoints only", True),
    "observability_config": VllmArg(None, "fleetllm exports no traces (OpenTelemetry)",
                                    True),
    "fully_sharded_loras": VllmArg(False, "adapters are sharded as their base layers are"),
    "enable_prompt_adapter": VllmArg(False, "no prompt adapters in fleetllm", True),
    "rope_scaling": VllmArg(None, "rope scaling comes from the checkpoint's config.json",
                            True),
    "rope_theta": VllmArg(None, "rope_theta comes from the checkpoint's config.json", True),
    "hf_overrides": VllmArg(None, "the checkpoint's config.json is used as it is", True),
    "revision": VllmArg(None, "fleetllm loads a local directory as it is", True),
    "tokenizer_revision": VllmArg(None, "fleetllm loads a local directory as it is", True),
    "skip_tokenizer_init": VllmArg(False, "outputs always carry text when there is a "
                                          "tokenizer", True),
}


_SECTIONS = (ModelConfig, CacheConfig, ParallelConfig, SchedulerConfig, DeviceConfig, LoadConfig,
             DecodingConfig, LoRAConfig)


def engine_arg_fields() -> list[tuple[type, dataclasses.Field]]:
    """(section, field) for each keyword argument from_kwargs routes to a section: the init
    fields, less `model` (positional) and the scheduler's copy of max_model_len."""
    return [(section, f) for section in _SECTIONS for f in dataclasses.fields(section)
            if f.init and f.name != "model"
            and not (section is SchedulerConfig and f.name == "max_model_len")]
