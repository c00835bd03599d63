"""DisaggProxy: `fleetllm proxy`'s OpenAI-compatible front for disaggregated prefill and
decode, speaking vLLM's toy-proxy protocol to `fleetllm serve` instances (or vLLM's).

How: a completion or chat request goes twice, with one X-Request-Id (the client's, else a new
one): first to a prefill instance (round robin) with max_tokens=1 (max_completion_tokens=1
when given), stream false and kv_transfer_params {do_remote_decode: true, ...}; that instance
(a kv_producer) stores the prompt's KV and answers with the kv_transfer_params the decode
instance needs. Then the client's own request goes to a decode instance (round robin) with
those params; its answer, streamed or not, is relayed to the client as it comes. /v1/models
is a decode instance's; /health is 200 while at least one prefill and one decode instance
answer theirs (its body: each instance's state), else 503.

What fails and how: every call has httpx's timeouts (upstreams.py). An instance that is
unreachable, breaks off or times out before the answer starts gives the client a 502 or 504
naming it (E012 UpstreamError); an HTTP error from an instance is relayed with its status and
body; a stream that breaks afterwards ends with an in-band error event. A client that goes
away cancels the leg in flight (its connection to the instance is closed, which aborts the
request there). The next request is served as usual: nothing is marked down.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fleetllm.entrypoints.openai.body_checks import ClientDisconnected, until_disconnected
from fleetllm.entrypoints.openai.errors import APIError, error_body, error_response
from fleetllm.entrypoints.openai.serving_engine import json_object
from fleetllm.entrypoints.proxy.upstreams import Upstreams
from fleetllm.errors import UpstreamError

# The prefill leg's kv_transfer_params, as vLLM's toy proxy sends them.
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                  "remote_port": None}
_FORWARDED_HEADERS = ("authorization",)
_HEALTH_TIMEOUT = 5.0


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request as its prefill leg: one token, not streamed, asking the prefill
    instance to keep the prompt's KV for a decode instance."""
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    leg["max_tokens"] = 1
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    leg["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return leg


async def _json_body(raw: Request) -> dict[str, Any] | Response:
    """The request's JSON object, or the 400 / 413 the client gets instead (the server's own
    reading, serving_engine.json_object); the instances check the rest."""
    try:
        return await json_object(raw)
    except APIError as e:
        return error_response(e.status, e.message)


class _Relayed(StreamingResponse):
    """A decode instance's stream, relayed; closing the body iterator however the response
    ends (a client disconnect cancels the send loop) closes the upstream connection now."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class DisaggProxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout: float = 300.0,
                 connect_timeout: float = 10.0):
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64))
        self.prefill = Upstreams("prefill", prefill, self.client, timeout)
        self.decode = Upstreams("decode", decode, self.client, timeout)

    async def aclose(self) -> None:
        await self.client.aclose()

    # ---------------------------------------------------------------- the two legs

    async def relay(self, raw: Request, path: str) -> Response:
        body = await _json_body(raw)
        if isinstance(body, Response):
            return body
        request_id = raw.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"X-Request-Id": request_id}
        headers.update({k: raw.headers[k] for k in _FORWARDED_HEADERS if k in raw.headers})
        echo = {"X-Request-Id": request_id}
        try:
            params = await until_disconnected(self._prefill(path, body, headers), raw)
            if isinstance(params, Response):  # the prefill instance's error, relayed
                params.headers.update(echo)
                return params
            decode_body = {**body, "kv_transfer_params": params} if params else body
            url = self.decode.next()
            if body.get("stream"):
                upstream = await until_disconnected(
                    self.decode.post(url, path, decode_body, headers, stream=True), raw)
                return await self._stream(url, upstream, echo)
            answer = await until_disconnected(
                self.decode.post(url, path, decode_body, headers), raw)
        except ClientDisconnected:
            return Response(status_code=499)
        except UpstreamError as e:
            return error_response(e.status, str(e), headers=echo)
        return Response(answer.content, answer.status_code, headers=echo,
                        media_type=answer.headers.get("content-type", "application/json"))

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]
                       ) -> dict[str, Any] | Response | None:
        """The decode leg's kv_transfer_params from a prefill instance (None when it gave
        none: the decode instance then computes the prompt), or its error as a Response."""
        url = self.prefill.next()
        answer = await self.prefill.post(url, path, prefill_body(body), headers)
        if not answer.is_success:
            return Response(answer.content, answer.status_code,
                            media_type=answer.headers.get("content-type", "application/json"))
        try:
            params = answer.json().get("kv_transfer_params")
        except (ValueError, AttributeError) as e:
            raise UpstreamError(f"the prefill instance {url} answered with a body that is not "
                                f"a JSON object: {e}", 502) from None
        return params if isinstance(params, dict) else None

    async def _stream(self, url: str, upstream: httpx.Response, echo: dict[str, str]
                      ) -> Response:
        if not upstream.is_success:
            try:
                content = await upstream.aread()
            except httpx.HTTPError as e:
                raise self.decode.error(url, e) from None
            finally:
                await upstream.aclose()
            return Response(content, upstream.status_code, headers=echo,
                            media_type=upstream.headers.get("content-type"))

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_bytes():  # content-encoding undone
                    yield chunk
            except httpx.HTTPError as e:
                err = self.decode.error(url, e)
                yield f"data: {json.dumps(error_body(err.status, str(err)))}\n\n".encode()
            finally:
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()

        return _Relayed(chunks(), upstream.status_code, media_type="text/event-stream",
                        headers={**echo, "Cache-Control": "no-cache"})

    # ---------------------------------------------------------------- the rest

    async def models(self) -> Response:
        url = self.decode.next()
        try:
            answer = await self.decode.get(url, "/v1/models")
        except UpstreamError as e:
            return error_response(e.status, str(e))
        return Response(answer.content, answer.status_code,
                        media_type=answer.headers.get("content-type", "application/json"))

    async def health(self) -> Response:
        async def one(pool: Upstreams, url: str) -> tuple[str, str]:
            try:
                answer = await pool.get(url, "/health", _HEALTH_TIMEOUT)
            except UpstreamError as e:
                return url, str(e)
            return url, "ok" if answer.status_code == 200 else f"HTTP {answer.status_code}"

        checks = [one(p, u) for p in (self.prefill, self.decode) for u in p.urls]
        results = dict(await asyncio.gather(*checks))
        legs = {p.leg: {u: results[u] for u in p.urls} for p in (self.prefill, self.decode)}
        up = all("ok" in leg.values() for leg in legs.values())
        return JSONResponse(legs, status_code=200 if up else 503)


def build_proxy_app(proxy: DisaggProxy) -> FastAPI:
    app = FastAPI(title="fleetllm proxy", docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await proxy.relay(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await proxy.relay(raw, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        return await proxy.models()

    @app.get("/health")
    async def health() -> Response:
        return await proxy.health()

    return app
