"""Helpers shared by layers that must not import each other (executors and workers both
resolve user-named classes; a worker must not depend on the executor that drives it), and
by the config sections."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import types
import typing
from typing import Any

from fleetllm.errors import ConfigurationError


def resolve_qualname(name: str) -> Any:
    """Import "pkg.module:Name" or "pkg.module.Name"."""
    module_name, _, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigurationError(f"cannot import {name!r}: {e}") from e


def check_setting(ok: bool, field_name: str, message: str) -> None:
    """A config section's check: not ok is a ConfigurationError naming the field."""
    if not ok:
        raise ConfigurationError(f"{field_name}: {message}")


def check_field_types(section: Any) -> None:
    """Check each init field of a dataclass (a config section) against its annotation.

    Called before any range check compares the values: a wrong type is then a
    ConfigurationError naming the field, not a TypeError from `"16" >= 1`. Generic over the
    annotations, so a new field needs no check of its own."""
    hints = _type_hints(type(section))
    for f in dataclasses.fields(section):
        if not f.init:  # derived, maybe not set yet
            continue
        value = getattr(section, f.name)
        if not _matches(value, hints[f.name]):
            raise ConfigurationError(f"{f.name}: must be {_describe(hints[f.name])}, got "
                                     f"{value!r}")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _union_args(hint: Any) -> tuple[Any, ...]:
    is_union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    return typing.get_args(hint) if is_union else ()


def _matches(value: Any, hint: Any) -> bool:
    if _union_args(hint):
        return any(_matches(value, h) for h in _union_args(hint))
    if hint is Any:  # a class since Python 3.11, but not one to isinstance against
        return True
    if hint is type(None):
        return value is None
    if hint in (int, float) and isinstance(value, bool):  # True is no count or size
        return False
    if hint is float:  # an int is fine where a float is expected, as in Python
        return isinstance(value, int | float)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # a generic (list[int], ...): the section checks it itself


def _describe(hint: Any) -> str:
    if _union_args(hint):
        return " or ".join(_describe(h) for h in _union_args(hint))
    names = {int: "an int", float: "a number", str: "a string", bool: "True or False",
             type(None): "None"}
    if hint in names:
        return names[hint]
    return f"a {hint.__module__}.{hint.__qualname__}" if isinstance(hint, type) else str(hint)


def dict_setting(name: str, value: Any, example: str) -> dict:
    """A setting given as a dict or its JSON text (what a command-line flag passes), as a new
    dict; anything else is a ConfigurationError naming the setting and an example."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigurationError(f"{name}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigurationError(f"{name}: must be a dict such as {example}, got {value!r}")
    return dict(value)
