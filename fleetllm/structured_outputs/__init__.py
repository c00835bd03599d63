"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or grammar
(backends.py: xgrammar / llguidance; manager.py: the engine's side). The sampler applies the
masks (worker/sampler.py)."""

from fleetllm.sampling_params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "StructuredOutputsParams"]
