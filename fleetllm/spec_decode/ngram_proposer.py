"""Prompt-lookup (n-gram) drafts: no second model. The last n tokens of a sequence (n from
prompt_lookup_max down to prompt_lookup_min) are looked for earlier in its prompt + output;
at the most recent earlier match, the tokens that followed are the draft (up to
num_speculative_tokens of them). Copy-heavy work (editing code it was shown, quoting a
document) repeats long spans, and those drafts are accepted."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NgramProposer:
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens}")

    def propose(self, token_ids: list[int]) -> list[int]:
        """The draft for a sequence whose tokens so far are token_ids ([] if none)."""
        k, size = self.num_speculative_tokens, len(token_ids)
        for n in range(min(self.prompt_lookup_max, size - 1), self.prompt_lookup_min - 1, -1):
            tail = token_ids[size - n:]
            # the most recent earlier occurrence whose continuation is known
            for start in range(size - n - 1, -1, -1):
                if token_ids[start:start + n] == tail:
                    return token_ids[start + n: start + n + k]
        return []
