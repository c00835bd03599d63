"""Multi-LoRA serving (issue #22): one base model, many PEFT adapters batched in one step.

- `request.py`: LoRARequest (vLLM's `vllm.lora.request`), what a request names;
- LoRAConfig, the engine's `enable_lora` / `max_loras` / ... settings: fleetllm/config_lora.py;
- `peft.py`: reading and validating a PEFT adapter directory (safetensors only);
- `layers.py`: the batched delta added to a projection's output for the step's adapter rows;
- `manager.py`: the worker's adapters: an LRU of loaded ones, `max_loras` device slots.
"""

from fleetllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
