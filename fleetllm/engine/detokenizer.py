"""Incremental detokenization and stop-string handling.

Decoding only the last few tokens each step (not the whole output) keeps detokenization
O(1) per token, while still handling multi-byte characters split across tokens and
tokenizers that merge spaces into the next token.
"""

from __future__ import annotations

from typing import Any

from fleetllm.sampling_params import SamplingParams
from fleetllm.sequence import Logprob, Sequence

_LOOKBACK = 6  # tokens of context decoded before the new ones


class Detokenizer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def start(self, seq: Sequence, params: SamplingParams) -> None:
        """Seed the incremental state with the prompt's tail."""
        if self.tokenizer is None:
            return
        tokens = self._tokens(seq.prompt_token_ids[-_LOOKBACK - 1:], params)
        seq.tokens = tokens
        seq.prefix_offset = max(len(tokens) - _LOOKBACK, 0)
        seq.read_offset = len(tokens)

    def decode_new_token(self, seq: Sequence, params: SamplingParams) -> str:
        """Append the text of the sequence's last token; returns the new text."""
        if self.tokenizer is None:
            return ""
        tok = self.tokenizer
        seq.tokens.extend(self._tokens(seq.output_token_ids[-1:], params))
        prefix = tok.convert_tokens_to_string(seq.tokens[seq.prefix_offset: seq.read_offset])
        text = tok.convert_tokens_to_string(seq.tokens[seq.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 character: wait for the next token
        new_text = text[len(prefix):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(seq.tokens)
        seq.output_text += new_text
        return new_text

    def _tokens(self, ids: list[int], params: SamplingParams) -> list[str]:
        # Ids past the tokenizer's vocabulary (models pad their embedding tables) have no
        # text: they come back as None and count as empty.
        tokens = self.tokenizer.convert_ids_to_tokens(
            ids, skip_special_tokens=params.skip_special_tokens)
        return [t for t in tokens if t is not None]

    def decode_logprobs(self, logprobs: dict[int, Logprob]) -> None:
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
