"""ServerGate: the ASGI layer in front of every route: the API key, draining, and the count
of requests in flight that a drain waits for. It runs before FastAPI reads a byte of the
body, so an unauthenticated or late client costs nothing."""

from __future__ import annotations

import asyncio
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

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
