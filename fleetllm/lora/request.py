"""LoRARequest, as vLLM's `vllm.lora.request.LoRARequest`: which adapter a request uses."""

from __future__ import annotations

import os
from dataclasses import dataclass

from fleetllm.errors import InvalidRequestError


@dataclass
class LoRARequest:
    """An adapter: `lora_name` (what users and the server call it), `lora_int_id` (>= 1, the
    id engines and workers key it by: one id is one adapter for the engine's lifetime) and
    `lora_path`, a local PEFT directory (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # the server's /v1/models "parent"; informational

    def __post_init__(self) -> None:
        if isinstance(self.lora_path, os.PathLike):
            self.lora_path = os.fspath(self.lora_path)
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) \
                or self.lora_int_id < 1:
            raise InvalidRequestError(f"lora_int_id must be an int >= 1, got "
                                      f"{self.lora_int_id!r}")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError(f"lora_name must be a non-empty string, got "
                                      f"{self.lora_name!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidRequestError(f"lora_path must name the adapter's directory, got "
                                      f"{self.lora_path!r}")

    # vLLM's accessors
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __hash__(self) -> int:
        return hash((self.lora_int_id, self.lora_name, self.lora_path))
