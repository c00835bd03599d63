"""The models a server answers to (vLLM's OpenAIServingModels): its base model's served
names and its LoRA adapters. A request's `model` picks one: a served name is the base model,
an adapter's name runs the request through that adapter, anything else is a 404.

Adapters come from `--lora-modules` (loaded before the server listens: a bad one stops the
start) and, with `--allow-runtime-lora-updating`, from POST /v1/load_lora_adapter and
/v1/unload_lora_adapter. Loading goes through the engine's add_lora, so a bad adapter (no
such directory, a rank over max_lora_rank, modules the model lacks) is refused before any
request uses it. Each load gets a new lora_int_id (1, 2, ...), never reused: the engine
caches adapters by id, so a name unloaded and loaded again from another path must not find
the old weights. The ids are this table's to give: one ServingModels per engine (an engine
refuses an id it knows for another path).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleetllm.engine.async_engine import EngineUnhealthyError
from fleetllm.entrypoints.openai.cli_args import LoRAModulePath
from fleetllm.entrypoints.openai.errors import APIError, truncate
from fleetllm.entrypoints.openai.protocol import (
    LoadLoRAAdapterRequest,
    ModelCard,
    UnloadLoRAAdapterRequest,
)
from fleetllm.errors import ConfigurationError, EngineShutdownError, EngineSleepingError
from fleetllm.lora.request import LoRARequest


class ServingModels:
    def __init__(self, engine: Any, base_model_names: list[str],
                 lora_modules: list[LoRAModulePath] | None = None):
        self.engine = engine
        self.base_model_names = base_model_names
        self.static_lora_modules = list(lora_modules or [])
        self.lora_requests: dict[str, LoRARequest] = {}  # name -> its request, in load order
        self._next_id = 1  # taken by a load that succeeds (under _lock)
        self._lock = asyncio.Lock()  # loads and unloads one at a time: names stay unique
        names = [m.name for m in self.static_lora_modules]
        clash = sorted({n for n in names if names.count(n) > 1 or n in base_model_names})
        if clash:
            raise ConfigurationError(f"lora_modules: the names {clash} are used twice (or "
                                     "are a served model name)")

    @property
    def base_model_name(self) -> str:
        return self.base_model_names[0]

    async def init_static_loras(self) -> None:
        """Load every --lora-modules adapter (once, before serving); a bad one raises
        ConfigurationError naming it."""
        for m in self.static_lora_modules:
            try:
                await self._load(m.name, m.path, m.base_model_name)
            except APIError as e:
                raise ConfigurationError(f"lora_modules: {m.name}={m.path}: {e.message}"
                                         ) from None

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); a 404 for a name
        this server does not serve."""
        if model is None or model in self.base_model_names:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            raise APIError(404, f"The model `{truncate(model, 100)}` does not exist.",
                           param="model")
        return lora

    def model_name(self, lora_request: LoRARequest | None) -> str:
        """The `model` a response reports: the adapter's name, else the first served name."""
        return lora_request.lora_name if lora_request is not None else self.base_model_name

    def cards(self) -> list[ModelCard]:
        config = self.engine.model_config
        base = [ModelCard(id=name, root=config.model, max_model_len=config.max_model_len,
                          task=config.task) for name in self.base_model_names]
        return base + [ModelCard(id=name, root=lora.lora_path, parent=lora.base_model_name)
                       for name, lora in self.lora_requests.items()]

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> str:
        if not body.lora_name or not body.lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        await self._load(body.lora_name, body.lora_path, None)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> str:
        if not body.lora_name:
            raise APIError(400, "'lora_name' needs to be provided.", "lora_name")
        async with self._lock:
            lora = self.lora_requests.get(body.lora_name)
            if lora is None:
                raise APIError(404, f"The lora adapter '{truncate(body.lora_name, 100)}' "
                               "cannot be found.", "lora_name")
            # Gone from the names first: no new request picks it while the engine drops it.
            del self.lora_requests[body.lora_name]
            await self.engine.remove_lora(lora.lora_int_id)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    async def _load(self, name: str, path: str, base_model_name: str | None) -> None:
        async with self._lock:
            if name in self.lora_requests or name in self.base_model_names:
                raise APIError(400, f"The lora adapter '{truncate(name, 100)}' has already "
                               "been loaded.", "lora_name")
            lora = LoRARequest(name, self._next_id, path,
                               base_model_name=base_model_name or self.base_model_name)
            try:
                await self.engine.add_lora(lora)
            except (EngineUnhealthyError, EngineShutdownError, EngineSleepingError):
                raise  # the engine's state, not the adapter's fault: a 503
            except Exception as e:  # no such directory, a rank too high, not enabled, ...
                raise APIError(400, f"could not load the LoRA adapter '{truncate(name, 100)}'"
                               f" from {truncate(path, 200)}: {truncate(str(e), 500)}",
                               "lora_path") from None
            self._next_id += 1
            self.lora_requests[name] = lora
