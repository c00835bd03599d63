"""Speculative decoding (vLLM's speculative_config): SpeculativeConfig (config.py), the n-gram
proposer, SpecDecodeWorker (the worker the configuration picks: proposes, has the scorer
score and accept), its metrics, and a general rejection sampler (rejection_sampler.py, for
proposers with a draft distribution)."""
