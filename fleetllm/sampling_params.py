"""SamplingParams: how one request's tokens are chosen, validated at construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from fleetllm.errors import ConfigurationError

_GREEDY_EPS = 1e-5
_INTS = ("n", "top_k", "min_tokens")
_OPTIONAL_INTS = ("seed", "max_tokens", "logprobs", "prompt_logprobs")
_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty")
_BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """An int or a float, as vLLM accepts for its float fields (temperature=1 is fine)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's names): exactly one of a JSON schema (a dict or its
    JSON text), any JSON object, a regular expression, one of N strings, or an EBNF (GBNF) /
    Lark grammar. The output follows it token by token (fleetllm/structured_outputs); the
    request finishes with "stop" when the constraint is complete."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without optional whitespace
    disable_additional_properties: bool = False  # objects get additionalProperties: false
    # JSON: at most this many optional whitespace characters per gap (None: the backends'
    # MAX_JSON_WHITESPACE; 0: as disable_any_whitespace). Tool calls use 1.
    json_whitespace_limit: int | None = None

    def __post_init__(self) -> None:
        given = [k for k in _CONSTRAINTS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ConfigurationError(
                "structured outputs take exactly one of json, regex, choice, grammar, "
                f"json_object; got {', '.join(given) or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "choice":
            if not (isinstance(value, list | tuple) and value
                    and all(isinstance(c, str) for c in value)):
                raise ConfigurationError(f"choice: must be a non-empty list of strings, got "
                                         f"{value!r}")
            object.__setattr__(self, "choice", list(value))
        elif kind == "json":
            if not isinstance(value, str | dict):
                raise ConfigurationError(f"json: must be a JSON schema (a dict or its JSON "
                                         f"text), got {type(value).__name__}")
        elif kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            raise ConfigurationError(f"{kind}: must be a non-empty string, got {value!r}")
        elif kind == "json_object" and value is not True:
            raise ConfigurationError(f"json_object: must be True, got {value!r}")
        if isinstance(value, dict):  # key() and the backends take its JSON text
            try:
                value = json.dumps(value)
            except (TypeError, ValueError) as e:
                raise ConfigurationError(f"json: the schema is not JSON ({e})") from None
        size = sum(map(len, value)) if kind == "choice" else \
            len(value) if isinstance(value, str) else 0
        if size > MAX_CONSTRAINT_CHARS:
            raise ConfigurationError(
                f"{kind}: {size:,} characters; a constraint takes at most "
                f"{MAX_CONSTRAINT_CHARS:,} (its compile time grows faster than its size and "
                "holds up every constrained request behind it)")
        limit = self.json_whitespace_limit
        if limit is not None and not (isinstance(limit, int) and not isinstance(limit, bool)
                                      and 0 <= limit <= 1000):
            raise ConfigurationError(f"json_whitespace_limit: must be None or an int in "
                                     f"[0, 1000], got {limit!r}")

    @property
    def kind(self) -> str:
        return next(k for k in _CONSTRAINTS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """Hashable identity (the grammar cache's key): equal constraints compile once."""
        value: Any = getattr(self, self.kind)
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        elif isinstance(value, list):
            value = tuple(value)
        return (self.kind, value, self.disable_any_whitespace,
                self.disable_additional_properties, self.json_whitespace_limit)

    def __hash__(self) -> int:
        return hash(self.key())


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
# The most characters of a constraint (a JSON schema's text, a regex, a grammar, the choices
# together): xgrammar's compile time grows faster than the text (demo vocabulary: 64 KiB
# 0.8-3.2 s, 300 KB 15-82 s), on the one grammar thread every constrained request waits on.
MAX_CONSTRAINT_CHARS = 64 * 1024
GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


# What a field's value may rule out of the fast paths (fleetllm/fast_paths.py): NOTHING (they
# honour it: after the step, in the prompt step, or only when sampling, which temperature
# decides), ARGMAX (the greedy passes: the token needs the sampler) or EVERY (the engine picks
# the allowed tokens between tokens). tests/engine/test_params.py fails on a field not listed here.
NOTHING, ARGMAX, EVERY = "nothing", "argmax", "every"
FAST_PATH_FIELDS: dict[str, str] = {
    "n": NOTHING, "temperature": ARGMAX,
    "top_p": NOTHING, "top_k": NOTHING, "min_p": NOTHING, "seed": NOTHING,  # sampling only
    "presence_penalty": ARGMAX, "frequency_penalty": ARGMAX, "repetition_penalty": ARGMAX,
    "max_tokens": NOTHING,
    "min_tokens": ARGMAX,  # until that many tokens exist (the sampler holds stop tokens back)
    "stop": NOTHING, "stop_token_ids": NOTHING, "ignore_eos": NOTHING, "eos_token_ids": NOTHING,
    "logprobs": ARGMAX, "prompt_logprobs": NOTHING,
    "include_stop_str_in_output": NOTHING, "skip_special_tokens": NOTHING,
    "structured_outputs": EVERY, "guided_decoding": EVERY,
    # what the KV connector loads or keeps (kv_transfer_config rules out multi-step and drafts)
    "kv_transfer_params": NOTHING,
}


@dataclass(frozen=True, slots=True)
class FastPaths:
    """A request's part of which fast paths may take it (SamplingParams.fast_paths)."""

    runs_ahead: bool  # its tokens may be chosen ahead of the engine: multi-step calls, drafts
    argmax_from: int | None  # from this many output tokens on, each is the plain argmax


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name, folded in
    # Set by the engine from the tokenizer/generation config; enforced with min_tokens.
    eos_token_ids: list[int] = field(default_factory=list, repr=False)
    # KV transfer (vLLM's kv_transfer_params; docs/kv_transfer.md): {"do_remote_decode": True}
    # asks a kv_producer to keep the prompt's KV for a decode instance; the params its output
    # returns (RequestOutput.kv_transfer_params) tell a kv_consumer what to load.
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ConfigurationError(f"{name}: {message}, got {getattr(self, name)!r}")

        # Types first, so a wrong one is reported by name rather than as a TypeError from a
        # range comparison below. bool is an int to Python but never a count or a number here.
        for name in _INTS:
            check(_is_int(getattr(self, name)), name, "must be an int")
        for name in _OPTIONAL_INTS:
            check(getattr(self, name) is None or _is_int(getattr(self, name)), name,
                  "must be an int or None")
        for name in _NUMBERS:
            check(_is_number(getattr(self, name)), name, "must be a number")
        for name in _BOOLS:
            check(isinstance(getattr(self, name), bool), name, "must be True or False")
        check(self.stop is None or isinstance(self.stop, str) or (
            isinstance(self.stop, list | tuple) and all(isinstance(s, str) and s
                                                         for s in self.stop)),
              "stop", "must be a string or a list of non-empty strings")
        for name in ("stop_token_ids", "eos_token_ids"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, list | tuple) and all(
                _is_int(t) and t >= 0 for t in value)), name,
                "must be a list of non-negative ints")

        check(self.kv_transfer_params is None or (isinstance(self.kv_transfer_params, dict)
                                                   and all(isinstance(k, str) for k in
                                                           self.kv_transfer_params)),
              "kv_transfer_params", "must be None or a JSON object")

        check(self.n >= 1, "n", "must be >= 1")
        check(0 <= self.temperature < math.inf, "temperature", "must be finite and >= 0")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        # Bounded so that no value reaches the workers that a tensor cannot hold.
        check(self.top_k == -1 or 0 <= self.top_k < 1 << 31, "top_k",
              "must be -1 (off), 0 (off) or a positive int below 2**31")
        check(self.seed is None or -(1 << 63) <= self.seed < 1 << 64, "seed",
              "must fit in 64 bits")
        check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        check(0 < self.repetition_penalty < math.inf, "repetition_penalty",
              "must be finite and > 0")
        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
              "must be None or >= 1")
        check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              "must be <= max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or 0 <= value <= 20, name, "must be None or in [0, 20]")
        if self.guided_decoding is not None:
            check(self.structured_outputs is None, "guided_decoding",
                  "is the old name of structured_outputs: give one of them")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):  # as JSON or a CLI would give it
            fields = self.structured_outputs
            unknown = sorted(set(fields) - set(StructuredOutputsParams.__dataclass_fields__))
            check(not unknown, "structured_outputs", f"has unknown fields {unknown}")
            self.structured_outputs = StructuredOutputsParams(**fields)
        check(self.structured_outputs is None or isinstance(self.structured_outputs,
                                                            StructuredOutputsParams),
              "structured_outputs", "must be StructuredOutputsParams or None")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.eos_token_ids = list(self.eos_token_ids)
        if self.temperature < _GREEDY_EPS:  # greedy: these knobs have no effect
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0
        if self.top_k == 0:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @cached_property
    def fast_paths(self) -> FastPaths:
        """What this request allows the fast paths (fleetllm/fast_paths.py), from the fields
        FAST_PATH_FIELDS says rule anything out; decided once: SamplingParams are not changed
        after they are built (the engine takes a copy)."""
        runs_ahead = self.structured_outputs is None  # guided_decoding is folded into it
        plain = runs_ahead and self.greedy and not self.has_penalties and self.logprobs is None
        return FastPaths(runs_ahead, self.min_tokens if plain else None)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)

    @property
    def min_tokens_stop_ids(self) -> list[int]:
        """Token ids that may not be sampled before min_tokens outputs exist."""
        return self.stop_token_ids + ([] if self.ignore_eos else self.eos_token_ids)

    def certain_tokens(self, room: int) -> int:
        """How many tokens each sample is certain to generate with `room` left in the
        context: all of max_tokens only when nothing can end a sample early (an EOS token, a
        stop string or stop token id), else min_tokens."""
        if self.stop or self.stop_token_ids or (self.eos_token_ids and not self.ignore_eos):
            return min(self.min_tokens, room)
        return room if self.max_tokens is None else min(self.max_tokens, room)
