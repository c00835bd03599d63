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


class NgramIndex:
    """NgramProposer.propose for one growing sequence in O(new tokens) per call, not a scan of
    its history: for each n-gram length, the most recent start of every n-gram whose next
    token is known, updated with the tokens added since the last call."""

    def __init__(self, proposer: NgramProposer) -> None:
        self.proposer = proposer
        self.sizes = range(proposer.prompt_lookup_min, proposer.prompt_lookup_max + 1)
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # tokens seen

    def propose(self, token_ids: list[int]) -> list[int]:
        size = len(token_ids)
        if size < self.indexed:  # not the sequence this index has seen grow: start over
            self.__init__(self.proposer)
        for n in self.sizes:  # n-grams whose continuation became known: ends in [old, size-1)
            table = self.latest[n]
            for start in range(max(0, self.indexed - n), size - n):
                table[tuple(token_ids[start:start + n])] = start
        self.indexed = size
        k = self.proposer.num_speculative_tokens
        for n in reversed(self.sizes):
            if n >= size:
                continue
            start = self.latest[n].get(tuple(token_ids[size - n:]))
            if start is not None:
                return token_ids[start + n: start + n + k]
        return []
