"""fleetllm: a small vLLM-style inference engine built around an executor layer."""

import os
from typing import Any

# OpenMP threads that spin-wait at barriers stall whenever a core is shared (another process,
# or the mp workers beside the driver): measured here, one decode attention went from 0.2 ms
# to 24 ms on 2 busy cores. Sleeping waits cost little; read once, before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

# Exported lazily: `import fleetllm.config` (as worker processes do) stays cheap.
_EXPORTS = {
    "LLM": "fleetllm.entrypoints.llm",
    "LLMEngine": "fleetllm.engine.llm_engine",
    "RequestOutput": "fleetllm.engine.outputs",
    "CompletionOutput": "fleetllm.engine.outputs",
    "SamplingParams": "fleetllm.sampling_params",
    "StructuredOutputsParams": "fleetllm.sampling_params",
    "GuidedDecodingParams": "fleetllm.sampling_params",
    "PoolingParams": "fleetllm.pooling_params",
    "PoolingRequestOutput": "fleetllm.engine.outputs",
    "EmbeddingRequestOutput": "fleetllm.engine.outputs",
    "ScoringRequestOutput": "fleetllm.engine.outputs",
    "EngineConfig": "fleetllm.config",
    "LoRARequest": "fleetllm.lora.request",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fleetllm' has no attribute {name!r}")
