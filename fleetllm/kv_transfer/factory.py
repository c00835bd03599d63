"""KVConnectorFactory: a connector class by name, or a user's own by module path.

`kv_connector` names one of CONNECTORS, or, with `kv_connector_module_path`, a class of that
module (a KVConnectorBase_V1 subclass). `connector_class` runs when the EngineConfig is built,
so a bad name is a ConfigurationError before any worker starts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from fleetllm.errors import ConfigurationError
from fleetllm.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole

if TYPE_CHECKING:
    from fleetllm.config import EngineConfig
    from fleetllm.config_kv_transfer import KVTransferConfig

# name -> "module:Class", imported on use
CONNECTORS = {
    "SharedStorageConnector": "fleetllm.kv_transfer.shared_storage:SharedStorageConnector",
}


def connector_class(kt: KVTransferConfig) -> type[KVConnectorBase_V1]:
    if kt.kv_connector_module_path is not None:
        where, field = f"{kt.kv_connector_module_path}:{kt.kv_connector}", \
            "kv_connector_module_path"
    elif kt.kv_connector in CONNECTORS:
        where, field = CONNECTORS[kt.kv_connector], "kv_connector"
    else:
        raise ConfigurationError(f"kv_transfer_config: kv_connector {kt.kv_connector!r} is not "
                                 f"one of {', '.join(CONNECTORS)} (a class of your own: "
                                 "name it and set kv_connector_module_path)")
    module_name, _, name = where.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ConfigurationError(f"kv_transfer_config: {field}: cannot import {name} from "
                                 f"{module_name}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        raise ConfigurationError(f"kv_transfer_config: {field}: {where} is not a "
                                 "KVConnectorBase_V1 subclass")
    return cls


def create_connector(config: EngineConfig, role: KVConnectorRole, rank: int = 0
                     ) -> KVConnectorBase_V1 | None:
    """The configured connector for `role` (None without kv_transfer_config)."""
    kt = config.kv_transfer_config
    if kt is None:
        return None
    return connector_class(kt)(config, role, rank)
