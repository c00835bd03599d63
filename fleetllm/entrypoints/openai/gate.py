"""The ASGI layers in front of every route. ServerGate: the API key, draining, and the count
of requests in flight that a drain waits for; it runs before FastAPI reads a byte of the
body, so an unauthenticated or late client costs nothing. RequestIdHeaders: X-Request-Id on
every response (--enable-request-id-headers)."""

from __future__ import annotations

import asyncio
import hmac
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleetllm.entrypoints.openai.errors import error_response

OPEN_PATHS = frozenset({"/health", "/metrics"})  # for probes and scrapers: no key, no drain


class ServerState:
    """Shared by the gate, /health and the drain: touched only on the event loop."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


class ServerGate:
    def __init__(self, app: ASGIApp, state: ServerState, api_key: str | None = None):
        self.app = app
        self.state = state
        self._expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self._expected is not None and not self._authorized(scope):
            response = error_response(401, "missing or invalid API key: send "
                                      "'Authorization: Bearer <key>'",
                                      headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        if self.state.draining:
            await error_response(503, "the server is shutting down")(scope, receive, send)
            return
        self.state.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.leave()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                # Constant time: the comparison must not leak how much of a guess was right.
                return hmac.compare_digest(value, self._expected or b"")
        return False


REQUEST_ID_HEADER = b"x-request-id"
MAX_REQUEST_ID_CHARS = 256


def valid_request_id(value: str) -> bool:
    """A client's X-Request-Id is used as the request id and may be echoed in a header: short
    printable ASCII only."""
    return 0 < len(value) <= MAX_REQUEST_ID_CHARS and value.isascii() and value.isprintable()


class RequestIdHeaders:
    """--enable-request-id-headers (as vLLM): every response carries X-Request-Id, the
    client's when it sent a valid one, else a fresh one, which the handlers then use as the
    request id too (the header is added to the request), so the two always agree."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = list(scope.get("headers", ()))
        given = next((v for k, v in headers if k == REQUEST_ID_HEADER), b"")
        value = given.decode("latin-1")
        if not value:  # none (or empty): this one is the request's id from here on
            value = uuid.uuid4().hex
            headers = [(k, v) for k, v in headers if k != REQUEST_ID_HEADER]
            scope = {**scope, "headers": [*headers, (REQUEST_ID_HEADER, value.encode())]}
        echo = valid_request_id(value)  # an invalid one is refused with a 400, not echoed

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start" and echo:
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (REQUEST_ID_HEADER, value.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)
