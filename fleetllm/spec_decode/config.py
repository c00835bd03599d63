"""SpeculativeConfig's old import path: the class lives beside fleetllm.config
(config_speculative.py)."""

from fleetllm.config_speculative import METHODS, SpeculativeConfig

__all__ = ["METHODS", "SpeculativeConfig"]
