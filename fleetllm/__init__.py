"""fleetllm: a small vLLM-style inference engine built around an executor layer."""

import os
from typing import Any

# torch's OpenMP threads (libgomp) wait for the next parallel region by spinning, then sleep.
# Sleeping at once (OMP_WAIT_POLICY=PASSIVE, the default here until 2026-11) made every oneDNN
# matmul of a decode step pay a wake-up: a 16-sequence Qwen2-0.5B step took 8-15% longer.
# Spinning forever (ACTIVE) starves whatever shares the cores (another process; the C++
# kernels' own pool). 10,000 spins, ~0.3 ms on a Zen 4 core, cover the gaps inside a step;
# libgomp drops to 100 where a process has more threads than CPUs. Read once, before torch
# loads; a policy or spin count the user set is kept.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"

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
