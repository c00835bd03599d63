"""RequestStream: one request's outputs, fed by the engine loop thread and read by one asyncio
task, with the deltas since the previous read (see async_engine's docstring). A pooling
request's PoolingRequestOutput (its one, finished output) passes through as it is."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleetllm.engine.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from fleetllm.sequence import Logprob


class _Aborter(Protocol):
    def abort(self, request_id: str, error: BaseException | None = None) -> None: ...


@dataclass
class StreamingCompletionOutput(CompletionOutput):
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, Logprob]] | None = None


class RequestStream:
    """One request's outputs: fed by the engine loop thread, read by one asyncio task.

    Outputs are cumulative, so a newer one replaces one the reader has not picked up yet
    (merge on put, as vLLM v1's RequestOutputCollector does): a slow reader holds at most one
    pending output, not one per step (which is quadratic in the output length). A finished
    output is never replaced, and an exception waits until the pending output is read."""

    def __init__(self, request_id: str, engine: _Aborter):
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._pending: RequestOutput | PoolingRequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._sent: dict[int, tuple[int, int]] = {}  # index -> (chars, tokens) released
        self._closed = False

    def put(self, item: RequestOutput | PoolingRequestOutput | BaseException) -> None:
        """Engine loop side."""
        deliver_threadsafe([(self, item)])

    def _put_local(self, item: RequestOutput | PoolingRequestOutput | BaseException) -> None:
        """On the stream's event loop: merge `item` into what is pending."""
        if isinstance(item, BaseException):
            if self._error is None:  # the first error is the cause; later ones follow it
                self._error = item
        elif self._pending is None or not self._pending.finished:
            self._pending = item
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput | PoolingRequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._pending is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._pending is not None:
            out, self._pending = self._pending, None
            self.finished = out.finished
            return self._with_deltas(out)
        self.finished, error, self._error = True, self._error, None
        raise error

    def _with_deltas(self, out: RequestOutput | PoolingRequestOutput
                     ) -> RequestOutput | PoolingRequestOutput:
        if isinstance(out, PoolingRequestOutput):  # one vector, nothing to take a delta of
            return out
        completions = []
        for c in out.outputs:
            # The engine's text only grows (it holds back what could start a stop string).
            sent_chars, sent_tokens = self._sent.get(c.index, (0, 0))
            self._sent[c.index] = (len(c.text), len(c.token_ids))
            completions.append(StreamingCompletionOutput(
                index=c.index, text=c.text, token_ids=c.token_ids,
                cumulative_logprob=c.cumulative_logprob, logprobs=c.logprobs,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                delta_text=c.text[sent_chars:],
                delta_token_ids=c.token_ids[sent_tokens:],
                delta_logprobs=None if c.logprobs is None else c.logprobs[sent_tokens:]))
        return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids,
                             out.prompt_logprobs, completions, out.finished, out.metrics,
                             out.error, out.kv_transfer_params)

    def close(self) -> None:
        """Abort the request unless it finished. Synchronous, so that it is safe in a `finally`
        of a generator being closed or cancelled."""
        if not self.finished and not self._closed:
            self._closed = True
            self._engine.abort(self.request_id)


def deliver_threadsafe(items: list[tuple[RequestStream, Any]]) -> None:
    """Hand items to their streams' event loops: one wake-up per loop per step, not one per
    request (64 streams would otherwise cost 64 self-pipe writes every step)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in items:
        by_loop.setdefault(stream._loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # that event loop is closed: nobody is listening
            pass


def _put_all(batch: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in batch:
        stream._put_local(item)
