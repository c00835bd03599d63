"""The engine's {token id: Logprob} dicts in the two OpenAI formats: completions' parallel
lists and chat's list of per-token objects.

A token's text is its text in context (what it adds after the tokens before it), never the
id decoded alone, which drops SentencePiece's leading spaces: generated tokens come decoded
that way from the engine, and a prompt's (echo) are decoded here the same way. So the tokens
join into the text, and `text_offset` is where each starts in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fleetllm.engine.detokenizer import Detokenizer, TokenTexts
from fleetllm.entrypoints.openai.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
)
from fleetllm.sequence import Logprob

_FLOOR = -9999.0  # OpenAI clients expect a number; a -inf logprob (underflow) becomes this


class LogprobFormatter:
    def __init__(self, tokenizer: Any, tokens_as_ids: bool = False,
                 skip_special_tokens: bool = True):
        self._detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.tokens_as_ids = tokens_as_ids
        self.skip_special_tokens = skip_special_tokens

    def token(self, token_id: int, lp: Logprob | None = None) -> str:
        if self.tokens_as_ids:  # vLLM's return_tokens_as_token_ids
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self._detokenizer is None:
            return ""
        return self._detokenizer.texts_in_context(TokenTexts(), [token_id],
                                                  self.skip_special_tokens)[0]

    def prompt_texts(self, token_ids: Sequence[int],
                     logprobs: Sequence[dict[int, Logprob] | None] = ()
                     ) -> tuple[list[str], list[dict[int, Logprob] | None]]:
        """The prompt's tokens decoded in context (they join into the prompt's text), and
        `logprobs` with every candidate decoded as it would follow the tokens before it."""
        entries = list(logprobs) + [None] * (len(token_ids) - len(logprobs))
        if self._detokenizer is None:
            return [""] * len(token_ids), entries
        detok, skip = self._detokenizer, self.skip_special_tokens
        state = TokenTexts()
        texts: list[str] = []
        decoded: list[dict[int, Logprob] | None] = []
        for token_id, entry in zip(token_ids, entries, strict=True):
            if entry is not None:
                candidates = list(entry)
                entry = {t: Logprob(lp.logprob, lp.rank, text) for (t, lp), text in zip(
                    entry.items(), detok.texts_in_context(state, candidates, skip),
                    strict=True)}
            decoded.append(entry)
            texts.append(detok.advance(state, token_id, skip))
        return texts, decoded

    def completion(self, token_ids: Sequence[int],
                   logprobs: Sequence[dict[int, Logprob] | None], text_offset: int,
                   texts: Sequence[str] | None = None) -> CompletionLogprobs:
        """Completions' format, offsets from `text_offset`; `texts`, when given, are the
        tokens' texts (a prompt's, from prompt_texts). A None entry (the first prompt token,
        when echoing) has no logprob."""
        out = CompletionLogprobs()
        for i, (token_id, entry) in enumerate(zip(token_ids, logprobs, strict=False)):
            chosen = entry.get(token_id) if entry is not None else None
            token = f"token_id:{token_id}" if self.tokens_as_ids else \
                texts[i] if texts is not None else self.token(token_id, chosen)
            out.tokens.append(token)
            out.token_logprobs.append(None if chosen is None else _finite(chosen.logprob))
            out.top_logprobs.append(None if entry is None else {
                self.token(t, lp): _finite(lp.logprob) for t, lp in _by_logprob(entry)})
            out.text_offset.append(text_offset)
            text_offset += len(token)
        return out

    def chat(self, token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]],
             top_n: int) -> ChatLogprobs:
        content = []
        for token_id, entry in zip(token_ids, logprobs, strict=False):
            chosen = entry.get(token_id)
            token = self.token(token_id, chosen)
            top = [self._top(t, lp) for t, lp in _by_logprob(entry)[:top_n]]
            content.append(TokenLogprob(
                token=token, logprob=_finite(chosen.logprob if chosen else float("-inf")),
                bytes=list(token.encode("utf-8", errors="replace")), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, lp: Logprob) -> TopLogprob:
        token = self.token(token_id, lp)
        return TopLogprob(token=token, logprob=_finite(lp.logprob),
                          bytes=list(token.encode("utf-8", errors="replace")))


def _by_logprob(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)


def _finite(value: float) -> float:
    return value if value > _FLOOR else _FLOOR
