"""KVTransferConfig: vLLM's `kv_transfer_config` dict, checked before any worker starts.

    LLM(model, kv_transfer_config={"kv_connector": "SharedStorageConnector",
                                   "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"shared_storage_path": DIR}})

`kv_connector` names a connector of fleetllm.kv_transfer.factory (or, with
`kv_connector_module_path`, a class of that module: a user's own KVConnectorBase_V1
subclass). Bad values raise ConfigurationError naming the field; the connector class is
resolved by EngineConfig (fleetllm.kv_transfer.factory.connector_class) at config time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from fleetllm.errors import ConfigurationError
from fleetllm.utils import dict_setting

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")  # vLLM's default: recompute


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"  # producer: saves only; consumer: loads only; both
    kv_load_failure_policy: str = "recompute"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None

    @classmethod
    def from_value(cls, value: Any) -> KVTransferConfig | None:
        """A KVTransferConfig, a dict with vLLM's keys, or its JSON text; None: off."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = dict_setting("kv_transfer_config", value,
                             '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigurationError(f"kv_transfer_config: {unknown} are not supported; known "
                                     f"keys: {', '.join(sorted(known))}")
        if "kv_connector" not in value:
            raise ConfigurationError("kv_transfer_config: kv_connector is required")
        return cls(**value)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigurationError:
            return ConfigurationError(f"kv_transfer_config: {name} {why}")

        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise bad("kv_connector", f"must be a connector name, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise bad("kv_role", f"must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise bad("kv_load_failure_policy", "must be one of "
                      f"{', '.join(KV_LOAD_FAILURE_POLICIES)}, "
                      f"got {self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise bad("kv_connector_extra_config", "must be a dict, got "
                      f"{self.kv_connector_extra_config!r}")
        path = self.kv_connector_module_path
        if path is not None and (not isinstance(path, str) or not path):
            raise bad("kv_connector_module_path", f"must be a module path, got {path!r}")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")
