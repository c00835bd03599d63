"""The engine's {token id: Logprob} dicts in the two OpenAI formats: completions' parallel
lists and chat's list of per-token objects."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fleetllm.entrypoints.openai.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
)
from fleetllm.sequence import Logprob

_FLOOR = -9999.0  # OpenAI clients expect a number; a -inf logprob (underflow) becomes this


class LogprobFormatter:
    def __init__(self, decode: Callable[[list[int]], str], tokens_as_ids: bool = False):
        self._decode = decode
        self.tokens_as_ids = tokens_as_ids

    def token(self, token_id: int, lp: Logprob | None = None) -> str:
        if self.tokens_as_ids:  # vLLM's return_tokens_as_token_ids
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self._decode([token_id])

    def completion(self, token_ids: Sequence[int],
                   logprobs: Sequence[dict[int, Logprob] | None], text_offset: int
                   ) -> CompletionLogprobs:
        """Completions' format. A None entry (the first prompt token, when echoing) has no
        logprob."""
        out = CompletionLogprobs()
        for token_id, entry in zip(token_ids, logprobs, strict=False):
            chosen = entry.get(token_id) if entry is not None else None
            token = self.token(token_id, chosen)
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
