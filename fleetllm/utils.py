"""Helpers shared by layers that must not import each other (executors and workers both
resolve user-named classes; a worker must not depend on the executor that drives it)."""

from __future__ import annotations

import importlib
from typing import Any

from fleetllm.errors import ConfigurationError


def resolve_qualname(name: str) -> Any:
    """Import "pkg.module:Name" or "pkg.module.Name"."""
    module_name, _, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigurationError(f"cannot import {name!r}: {e}") from e
