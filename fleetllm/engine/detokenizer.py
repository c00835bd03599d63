"""Incremental detokenization and stop-string handling.

Decoding only the last few tokens each step (not the whole output) keeps detokenization
O(1) per token, while still handling multi-byte characters split across tokens and
tokenizers that merge spaces into the next token.
"""

from __future__ import annotations

from collections.abc import Sequence as Ids
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleetllm.sampling_params import SamplingParams
from fleetllm.sequence import Logprob, Sequence

_LOOKBACK = 6  # tokens of context decoded before the new ones


class DecodeState(Protocol):
    """Where incremental decoding stands: a Sequence, or a TokenTexts."""

    tokens: list[str] | None
    prefix_offset: int
    read_offset: int


@dataclass
class TokenTexts:
    """A DecodeState of its own, for decoding ids that are not a Sequence's output (a
    prompt's, for its logprobs)."""

    tokens: list[str] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0


class Detokenizer:
    """Decodes token ids into text a few tokens at a time, each in the context of the tokens
    before it. Decoding an id alone is wrong for SentencePiece tokenizers (Llama-2, Mistral):
    "▁world" alone decodes to "world", after another token to " world"."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._special: frozenset[int] | None = None  # its special ids, read once

    def start(self, seq: Sequence, params: SamplingParams) -> None:
        """Seed the incremental state with the prompt's tail."""
        if self.tokenizer is None:
            return
        self.seed(seq, seq.prompt_token_ids[-_LOOKBACK - 1:], params.skip_special_tokens)

    def seed(self, state: DecodeState, ids: Ids[int], skip_special_tokens: bool) -> None:
        """Start `state` after `ids`, whose text counts as already read."""
        tokens = self._tokens(ids, skip_special_tokens)
        state.tokens = tokens
        state.prefix_offset = max(len(tokens) - _LOOKBACK, 0)
        state.read_offset = len(tokens)

    def decode_new_token(self, seq: Sequence, params: SamplingParams) -> str:
        """Append the text of the sequence's last token; returns the new text. When logprobs
        are kept, the token's and its alternatives' decoded_token become their text here:
        the chosen token's is exactly the text it added, so a request's logprob tokens join
        into its text."""
        if self.tokenizer is None:
            return ""
        skip = params.skip_special_tokens
        entry = seq.output_logprobs[-1] if params.logprobs is not None and \
            seq.output_logprobs else None
        token = seq.output_token_ids[-1]
        if entry is not None:
            others = [t for t in entry if t != token]
            for t, text in zip(others, self.texts_in_context(seq, others, skip), strict=True):
                entry[t].decoded_token = text
        new_text = self.advance(seq, token, skip)
        if entry is not None and token in entry:
            entry[token].decoded_token = new_text
        seq.output_text += new_text
        return new_text

    def advance(self, state: DecodeState, token_id: int, skip_special_tokens: bool) -> str:
        """Append one token to `state`; returns the text it releases ("" while it ends in an
        incomplete UTF-8 character, which the next token then releases)."""
        assert state.tokens is not None
        state.tokens.extend(self._tokens([token_id], skip_special_tokens))
        text = self._new_text(state.tokens, state.prefix_offset, state.read_offset)
        if text:
            state.prefix_offset, state.read_offset = state.read_offset, len(state.tokens)
        return text

    def texts_in_context(self, state: DecodeState, ids: Ids[int], skip_special_tokens: bool
                         ) -> list[str]:
        """The text each of `ids` would release as the next token; `state` is unchanged."""
        assert state.tokens is not None
        context = state.tokens[state.prefix_offset:]
        read = state.read_offset - state.prefix_offset
        return [self._new_text(context + self._tokens([t], skip_special_tokens), 0, read)
                for t in ids]

    def _new_text(self, tokens: list[str], prefix_offset: int, read_offset: int) -> str:
        tok = self.tokenizer
        prefix = tok.convert_tokens_to_string(tokens[prefix_offset:read_offset])
        text = tok.convert_tokens_to_string(tokens[prefix_offset:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 character: wait for the next token
        return text[len(prefix):]

    def _tokens(self, ids: Ids[int], skip_special_tokens: bool) -> list[str]:
        # Ids past the tokenizer's vocabulary (models pad their embedding tables) have no
        # text: they come back as None and count as empty.
        # Special ids are skipped here: transformers' skip_special_tokens rebuilds the list of
        # them (all_special_ids) at every call, ~20 us of each decode step's token.
        ids = list(ids)
        tokens = self.tokenizer.convert_ids_to_tokens(ids)
        if skip_special_tokens:
            if self._special is None:
                self._special = frozenset(self.tokenizer.all_special_ids)
            tokens = [t for i, t in zip(ids, tokens, strict=True) if i not in self._special]
        return [t for t in tokens if t is not None]

    def decode_logprobs(self, logprobs: dict[int, Logprob]) -> None:
        """Each id decoded alone: for the entries of a stopping token, whose text is not
        part of the output and so never decoded in context (decode_new_token)."""
        if self.tokenizer is None:
            return
        for token_id, lp in logprobs.items():
            if lp.decoded_token is None:
                lp.decoded_token = self.tokenizer.decode([token_id])


def find_stop_string(seq: Sequence, new_text_len: int, params: SamplingParams) -> str | None:
    """If a stop string appeared in the newly added text, truncate the output at the earliest
    match (keeping the stop string when include_stop_str_in_output) and return it. Of several
    matches the one that starts first wins, whatever the order of the list."""
    if not params.stop or not new_text_len:
        return None
    text = seq.output_text
    best: tuple[int, str] | None = None
    for stop in params.stop:
        # Only matches that overlap the new text can be new.
        start = max(0, len(text) - new_text_len - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None:
        return None
    index, stop = best
    seq.output_text = text[:index + len(stop) if params.include_stop_str_in_output else index]
    return stop


def held_back_length(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that could still grow into a stop string (a proper
    prefix of one). Showing only what comes before it keeps streamed text monotonic: a stop
    string found later never cuts into text already returned."""
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return held
