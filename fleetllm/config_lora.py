"""LoRAConfig: the engine's LoRA settings (vLLM's names). A section of EngineConfig's flat
keyword arguments, so `--enable-lora`, `--max-loras`, ... are CLI flags like the others;
`EngineConfig.lora_config` holds it when enable_lora is set, else None."""

from __future__ import annotations

from dataclasses import dataclass

from fleetllm.errors import ConfigurationError
from fleetllm.utils import check_field_types

LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class LoRAConfig:
    # Serve LoRA adapters (requests name one with a LoRARequest).
    enable_lora: bool = False
    # Adapters a single step may use (each has a device slot; the scheduler keeps a step's
    # distinct adapters within it).
    max_loras: int = 1
    # The largest adapter rank accepted (slots are sized for it).
    max_lora_rank: int = 16
    # Adapters kept loaded in host memory per worker (an LRU); None: max_loras.
    max_cpu_loras: int | None = None
    # The adapters' weights dtype: "auto" is the model's.
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"{name}: must be an int >= 1, got {value!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ConfigurationError(f"max_cpu_loras: {self.max_cpu_loras} is less than "
                                     f"max_loras={self.max_loras}; it must hold at least the "
                                     "adapters of one step")
        if self.lora_dtype not in LORA_DTYPES:
            raise ConfigurationError(f"lora_dtype: must be one of {', '.join(LORA_DTYPES)}; "
                                     f"got {self.lora_dtype!r}")
