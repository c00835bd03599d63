"""SpeculativeConfig: vLLM's `speculative_config` dict, checked.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    LLM(model, speculative_config={"method": "draft_model", "model": "/path/to/small",
                                   "num_speculative_tokens": 4})

Proposers: "ngram" (prompt lookup) and "draft_model" (a smaller checkpoint with the target's
vocabulary, run greedily beside the target on its output rank; capped at its own context
length, as in vLLM: a sequence past it decodes without drafts). Other methods (EAGLE, Medusa,
MTP) are refused with a ConfigurationError, never accepted and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from fleetllm.errors import ConfigurationError
from fleetllm.utils import dict_setting

METHODS = ("ngram", "draft_model")
_NOT_YET = {"eagle": "EAGLE heads are not supported", "eagle3": "EAGLE heads are not supported",
            "medusa": "Medusa heads are not supported", "mlp_speculator": "not supported",
            "mtp": "multi-token-prediction heads are not supported"}


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    method: str = "ngram"
    # n-gram: the longest and shortest tail matched against the earlier tokens (vLLM's
    # defaults: both 5 when neither is set; one set: the other takes its value).
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    # draft_model: the draft checkpoint's directory, and its tensor-parallel size (1).
    model: str | None = None
    draft_tensor_parallel_size: int = 1
    # draft_model: the longest sequence drafted (vLLM's key). None: the shorter of the
    # draft's and the target's max_model_len (EngineConfig sets it).
    max_model_len: int | None = None

    @classmethod
    def from_value(cls, value: Any) -> SpeculativeConfig | None:
        """A SpeculativeConfig, a dict with vLLM's keys, or its JSON text; None: off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = dict_setting("speculative_config", value,
                             "{'method': 'ngram', 'num_speculative_tokens': 4}")
        method = value.pop("method", None)
        model = value.pop("model", None)
        if model in ("ngram", "[ngram]"):  # vLLM's older spelling
            method, model = method or "ngram", None
        if method is None and model is not None:
            method = "draft_model"
        if method in _NOT_YET:
            raise ConfigurationError(f"speculative_config: method {method!r}: "
                                     f"{_NOT_YET[method]}")
        if method not in METHODS:
            raise ConfigurationError(f"speculative_config: method must be one of "
                                     f"{', '.join(METHODS)}, got {method!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigurationError(f"speculative_config: {unknown} are not supported; "
                                     f"known keys: method, model, {', '.join(sorted(known))}")
        if "num_speculative_tokens" not in value:
            raise ConfigurationError("speculative_config: num_speculative_tokens is required")
        lo, hi = value.pop("prompt_lookup_min", None), value.pop("prompt_lookup_max", None)
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        return cls(method=method, prompt_lookup_min=lo, prompt_lookup_max=hi,
                   model=None if model is None else str(model), **value)

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigurationError(f"speculative_config: {name} must be an int >= 1, "
                                         f"got {v!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigurationError("speculative_config: a draft model's directory goes in "
                                     "'model', with method 'draft_model' (or none)")
        if self.max_model_len is not None and (
                not isinstance(self.max_model_len, int) or isinstance(self.max_model_len, bool)
                or self.max_model_len < 1 or self.method != "draft_model"):
            raise ConfigurationError("speculative_config: max_model_len is a draft model's "
                                     f"(an int >= 1), got {self.max_model_len!r} with "
                                     f"method {self.method!r}")
        if self.draft_tensor_parallel_size != 1:
            raise ConfigurationError("speculative_config: draft_tensor_parallel_size must be "
                                     f"1, got {self.draft_tensor_parallel_size!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigurationError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not "
                f"exceed prompt_lookup_max ({self.prompt_lookup_max})")
