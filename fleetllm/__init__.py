"""fleetllm: a small vLLM-style inference engine built around an executor layer."""

from typing import Any

__version__ = "0.1.0"

# Exported lazily: `import fleetllm.config` (as worker processes do) stays cheap.
_EXPORTS = {
    "LLM": "fleetllm.entrypoints.llm",
    "LLMEngine": "fleetllm.engine.llm_engine",
    "RequestOutput": "fleetllm.engine.outputs",
    "CompletionOutput": "fleetllm.engine.outputs",
    "SamplingParams": "fleetllm.sampling_params",
    "EngineConfig": "fleetllm.config",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fleetllm' has no attribute {name!r}")
