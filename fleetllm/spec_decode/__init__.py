"""Speculative decoding building blocks (#19, in progress): the n-gram (prompt lookup) proposer
and the rejection sampler. Not wired into the engine yet: `speculative_config` is still
refused (fleetllm/config.py)."""
