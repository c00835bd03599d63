"""LoRAConfig's old import path: the class lives beside fleetllm.config (config_lora.py)."""

from fleetllm.config_lora import LORA_DTYPES, LoRAConfig

__all__ = ["LORA_DTYPES", "LoRAConfig"]
