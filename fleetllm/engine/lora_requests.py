"""The engine's side of LoRA: add/remove/pin/list_loras (LoRAMixin, on LLMEngine); a
request's LoRARequest is checked when it is added (the
adapter's files read and validated, fleetllm/lora/peft.py), so a bad adapter refuses that
request (LoRAAdapterError: an InvalidRequestError and a ConfigurationError) instead of
failing a step on the workers. One lora_int_id is one adapter for the engine's lifetime
(until remove_lora): workers cache adapters by id."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleetllm.config import EngineConfig
from fleetllm.errors import ConfigurationError, InvalidRequestError, LoRAAdapterError
from fleetllm.lora.peft import read_adapter
from fleetllm.lora.request import LoRARequest


class LoRARequests:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.known: dict[int, LoRARequest] = {}  # checked adapters, by id

    def check(self, request: LoRARequest | None) -> bytes | None:
        """Validate a request's adapter (None: the base model); returns the prefix-cache salt
        that keeps its KV apart from every other adapter's."""
        if request is None:
            return None
        lora = self.config.lora_config
        if lora is None:
            raise InvalidRequestError("lora_request: this engine serves no LoRA adapters; "
                                      "start it with enable_lora=True")
        if not isinstance(request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got "
                                      f"{type(request).__name__}")
        known = self.known.get(request.lora_int_id)
        if known is None:
            try:
                read_adapter(request.lora_path, lora.max_lora_rank,
                             self.config.model_config.arch)
            except ConfigurationError as e:
                raise LoRAAdapterError(f"lora_request {request.lora_name!r}: {e.args[0]}") from e
            self.known[request.lora_int_id] = request
        elif known.lora_path != request.lora_path:
            raise InvalidRequestError(
                f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} at "
                f"{known.lora_path}, not {request.lora_path}: one id is one adapter (remove_lora "
                "it first to reuse the id)")
        return f"lora:{request.lora_int_id}:{request.lora_path}".encode()

    def forget(self, lora_id: int) -> None:
        self.known.pop(lora_id, None)


class LoRAMixin:
    """LLMEngine's adapter management (vLLM's names): the executor's, after the engine's
    checks. A mixin of LLMEngine (it reads the engine's config, checker and executor)."""

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter on every worker ahead of its requests (they would load it on
        first use). A bad adapter raises LoRAAdapterError; without enable_lora,
        ConfigurationError."""
        if self.config.lora_config is None:
            raise ConfigurationError("enable_lora: LoRA adapters need enable_lora=True")
        self.lora_requests.check(lora_request)
        return self._on_workers(lambda: self.model_executor.add_lora(lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter from the workers (a request naming it again loads it again);
        its id may then name another adapter."""
        self.lora_requests.forget(lora_id)
        return self._on_workers(lambda: self.model_executor.remove_lora(lora_id))

    def pin_lora(self, lora_id: int) -> bool:
        """Keep a loaded adapter from eviction (False: it is not loaded)."""
        return self._on_workers(lambda: self.model_executor.pin_lora(lora_id))

    def list_loras(self) -> set[int]:
        """Ids of the adapters the workers hold loaded."""
        return self._on_workers(self.model_executor.list_loras)

    def _on_workers(self, call: Callable[[], Any]) -> Any:
        """The call, after replacing workers found dead or hung (as a failed step would:
        RecoveryMixin._recovering) and calling again."""
        result: list[Any] = []
        self._recovering(lambda: result.append(call()))
        return result[-1]
