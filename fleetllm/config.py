"""Engine configuration: one dataclass per concern, all held by EngineConfig.

`EngineConfig.from_kwargs(model=..., **kwargs)` takes the flat keyword names vLLM users know
(tensor_parallel_size, block_size, max_num_seqs, dtype, ...). Every value is validated here, so
a bad setting fails before any process starts, with a ConfigurationError naming the field.
The sections live here and beside it: config_model.py (the checkpoint: ModelConfig,
ArchConfig), config_lora.py, config_speculative.py, config_pooler.py, and config_vllm.py (vLLM
arguments without a field), whose names it still exports. They import nothing of
fleetllm but errors and utils (tests/project/test_layering.py), so every layer can read them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from fleetllm.config_kv_transfer import KVTransferConfig
from fleetllm.config_lora import LoRAConfig
from fleetllm.config_model import (  # noqa: F401 - re-exported: their old import path
    DTYPES,
    RUNNERS,
    SUPPORTED_ARCHITECTURES,
    TASKS,
    ArchConfig,
    ModelConfig,
    hf_tensor_shapes,
    read_json,
)
from fleetllm.config_pooler import (  # noqa: F401 - re-exported
    PoolerConfig,
    checkpoint_pooler,
    is_sentence_transformers,
)
from fleetllm.config_speculative import SpeculativeConfig
from fleetllm.config_vllm import SPEC_FLAT_ARGS, VLLM_ARGS, VllmArg  # noqa: F401 - re-exported
from fleetllm.errors import ConfigurationError, ModelLoadError
from fleetllm.utils import check_field_types
from fleetllm.utils import check_setting as _check

# The grammar backends (fleetllm/structured_outputs/backends.py) a DecodingConfig may name.
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")
GiB = 1 << 30


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
        return model_dtype if self.kv_cache_dtype == "auto" else DTYPES[self.kv_cache_dtype]


KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's names


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # MoE: each TP rank holds E / tp whole experts, not a slice of all (dense: ignored)
    enable_expert_parallel: bool = False
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
    # KV transfer (fleetllm/kv_transfer): a dict with vLLM's keys becomes this.
    kv_transfer_config: KVTransferConfig | None = None

    def __post_init__(self) -> None:
        m, s, p = self.model_config, self.scheduler_config, self.parallel_config
        s.max_model_len = m.max_model_len
        a, tp, pp = m.arch, p.tensor_parallel_size, p.pipeline_parallel_size
        _check(a.num_heads % tp == 0, "tensor_parallel_size",
               f"{a.num_heads} attention heads are not divisible by tensor_parallel_size={tp}")
        _check(a.num_kv_heads % tp == 0 or tp % a.num_kv_heads == 0, "tensor_parallel_size",
               f"{a.num_kv_heads} KV heads and tensor_parallel_size={tp}: one must divide the "
               "other")
        ep = p.enable_expert_parallel and bool(a.num_experts)
        _check(not ep or a.num_experts % tp == 0, "enable_expert_parallel",
               f"{a.num_experts} experts are not divisible by tensor_parallel_size={tp}: "
               "expert parallelism gives each rank the same number of whole experts")
        for size in (0 if ep else a.moe_intermediate_size, a.shared_expert_intermediate_size):
            _check(size % tp == 0, "tensor_parallel_size",
                   f"the experts' intermediate size {size} is not divisible by "
                   f"tensor_parallel_size={tp}")
        _check(a.intermediate_size % tp == 0, "tensor_parallel_size",
               f"intermediate_size {a.intermediate_size} is not divisible by {tp}")
        _check(pp <= a.num_layers, "pipeline_parallel_size",
               f"{pp} stages for a model of {a.num_layers} layers: use at most {a.num_layers}")
        _check(self.lora_config is None or not m.is_pooling, "enable_lora",
               "LoRA adapters apply to generating models only (task='generate')")
        _check(self.lora_config is None or not a.num_experts, "enable_lora",
               f"LoRA adapters on mixture-of-experts models ({a.architecture}) are not "
               "supported")
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
        self.kv_transfer_config = kt = KVTransferConfig.from_value(self.kv_transfer_config)
        if kt is not None:  # the connector's hooks wrap one plain forward per step
            _check(not m.is_pooling, "kv_transfer_config",
                   "KV transfer applies to generating models only (task='generate')")
            _check(spec is None, "kv_transfer_config",
                   "KV transfer and speculative decoding cannot be combined yet")
            _check(s.num_scheduler_steps == 1, "kv_transfer_config",
                   "KV transfer and multi-step decoding (num_scheduler_steps > 1) cannot be "
                   "combined yet")

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
            elif key in ("lora_config", "speculative_config", "kv_transfer_config"):
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


_SECTIONS = (ModelConfig, CacheConfig, ParallelConfig, SchedulerConfig, DeviceConfig, LoadConfig,
             DecodingConfig, LoRAConfig)


def engine_arg_fields() -> list[tuple[type, dataclasses.Field]]:
    """(section, field) for each keyword argument from_kwargs routes to a section: the init
    fields, less `model` (positional) and the scheduler's copy of max_model_len."""
    return [(section, f) for section in _SECTIONS for f in dataclasses.fields(section)
            if f.init and f.name != "model"
            and not (section is SchedulerConfig and f.name == "max_model_len")]
