"""Reading a request's engine streams back: merged as their outputs come (a stream of
several prompts), or each one's final output, collected while watching for the client to go
away. A request the engine ended with an error raises it (checked)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import Request

from fleetllm.engine.async_engine import RequestStream
from fleetllm.engine.outputs import PoolingRequestOutput, RequestOutput
from fleetllm.entrypoints.openai.body_checks import ClientDisconnected, disconnected
from fleetllm.errors import RequestFailedError

Out = TypeVar("Out", RequestOutput, PoolingRequestOutput)
_END = object()


def checked(out: Out) -> Out:
    """A request the engine ended with an error (finish_reason "error", or a pooling request
    with no vector) raises RequestFailedError (a 500 with the reason, or an in-band error
    event): "error" is not an OpenAI finish reason and would hide why."""
    failed = out.finish_reason == "error" if isinstance(out, PoolingRequestOutput) else \
        any(c.finish_reason == "error" for c in out.outputs)
    if out.error is not None or failed:
        raise RequestFailedError(out.error or "the engine ended the request with an error")
    return out



async def merge_streams(streams: list[RequestStream]
                        ) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, output) from several streams as they come; closes them all at the end."""
    if len(streams) == 1:  # the common case needs no task and no queue
        try:
            async for out in streams[0]:
                yield 0, checked(out)
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, checked(out)))
            queue.put_nowait((i, _END))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def collect_final(streams: list[RequestStream], request: Request | None
                        ) -> list[Any]:
    """Every stream's final output (RequestOutput, or PoolingRequestOutput for a pooling
    request). Raises ClientDisconnected (the requests aborted) if the client goes away
    first."""

    async def last(stream: RequestStream) -> Any:
        final = None
        async for out in stream:
            final = checked(out)
        assert final is not None  # a stream ends with its finished output or raises
        return final

    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    waiters: set[asyncio.Future] = set(tasks)
    gone = None
    if request is not None:
        gone = asyncio.ensure_future(disconnected(request))
        waiters.add(gone)
    try:
        while True:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if gone is not None and gone in done:
                raise ClientDisconnected
            for task in done:
                task.result()  # an engine error: raise it now
            waiters -= done
            if all(t.done() for t in tasks):
                return [t.result() for t in tasks]
    finally:
        for task in [*tasks, *([gone] if gone else [])]:
            task.cancel()
        for stream in streams:
            stream.close()


