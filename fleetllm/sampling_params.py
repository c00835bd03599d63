"""SamplingParams: how one request's tokens are chosen, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetllm.errors import ConfigurationError

_GREEDY_EPS = 1e-5


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
    # Set by the engine from the tokenizer/generation config; enforced with min_tokens.
    eos_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ConfigurationError(f"{name}: {message}, got {getattr(self, name)!r}")

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an int >= 1")
        check(self.temperature >= 0, "temperature", "must be >= 0")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0), "top_k",
              "must be -1 (off), 0 (off) or a positive int")
        check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an int or None")
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int)
              and self.max_tokens >= 1), "max_tokens", "must be None or an int >= 1")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
              "must be an int >= 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              "must be <= max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and 0 <= value <= 20), name,
                  "must be None or an int in [0, 20]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        check(all(isinstance(s, str) and s for s in self.stop), "stop",
              "must be non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative ints")
        if self.temperature < _GREEDY_EPS:  # greedy: these knobs have no effect
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0
        if self.top_k == 0:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)

    @property
    def min_tokens_stop_ids(self) -> list[int]:
        """Token ids that may not be sampled before min_tokens outputs exist."""
        return self.stop_token_ids + ([] if self.ignore_eos else self.eos_token_ids)
