"""Speculative decoding (vLLM's speculative_config): the n-gram and draft-model proposers,
SpecDecodeWorker (the worker the configuration picks: proposes, has the scorer score and
accept) and its metrics. SpeculativeConfig lives in fleetllm/config_speculative.py."""
