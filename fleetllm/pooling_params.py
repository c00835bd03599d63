"""PoolingParams: what one embedding request asks of the pooler, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from fleetllm.errors import ConfigurationError


@dataclass
class PoolingParams:
    # Matryoshka truncation: keep the first `dimensions` values (before normalizing), where
    # the model says it was trained for it (config.json `matryoshka_dimensions` or
    # `is_matryoshka`). None: the full hidden size.
    dimensions: int | None = None
    # Scale the vector to unit length; None: the model's pooler config decides.
    normalize: bool | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ConfigurationError(f"dimensions: must be an int >= 1 or None, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ConfigurationError(f"normalize: must be a bool or None, got "
                                     f"{self.normalize!r}")
