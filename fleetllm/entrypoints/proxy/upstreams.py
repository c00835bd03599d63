"""Upstreams: the prefill or decode instances behind `fleetllm proxy`, taken in turn, and the
one HTTP call the proxy makes to one of them.

How: `next()` is round robin over the instances' base URLs (the proxy runs on one event loop:
no lock). `post()` sends a JSON body with httpx (one AsyncClient for the proxy's lifetime, so
connections are kept alive); `stream=True` returns as soon as the headers arrived, for the
caller to relay the body chunk by chunk and close.

What fails and how: every wait is bounded by httpx's timeouts (connect, and read: per chunk,
so a stream that stalls fails too). An instance that refuses the connection or breaks off its
answer is an UpstreamError with status 502; one that does not answer in time, 504. Both name
the leg and the instance's URL. An HTTP error status from an instance is not an exception:
the caller relays it as it came (a 400 stays the client's 400).
"""

from __future__ import annotations

from typing import Any

import httpx

from fleetllm.errors import ConfigurationError, UpstreamError


def check_url(url: str, flag: str) -> str:
    """`url` without a trailing slash; ConfigurationError unless it is http(s)://host[:port]."""
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigurationError(f"{flag}: {url!r} is not an http(s):// URL of a "
                                 "`fleetllm serve` instance")
    return url.rstrip("/")


class Upstreams:
    def __init__(self, leg: str, urls: list[str], client: httpx.AsyncClient, timeout: float):
        if not urls:
            raise ConfigurationError(f"--{leg}: give at least one instance URL")
        self.leg = leg  # "prefill" or "decode"
        self.urls = [check_url(u, f"--{leg}") for u in urls]
        self.client = client
        self.timeout = timeout
        self._turn = 0

    def next(self) -> str:
        url = self.urls[self._turn % len(self.urls)]
        self._turn += 1
        return url

    def error(self, url: str, e: httpx.HTTPError) -> UpstreamError:
        if isinstance(e, httpx.TimeoutException):
            return UpstreamError(f"the {self.leg} instance {url} did not answer within "
                                 f"{self.timeout:g} s ({type(e).__name__})", 504)
        return UpstreamError(f"the {self.leg} instance {url} failed: {type(e).__name__}: "
                             f"{e}".rstrip(": "), 502)

    async def post(self, url: str, path: str, body: dict[str, Any], headers: dict[str, str],
                   stream: bool = False) -> httpx.Response:
        """The instance's response (with stream=True, unread: the caller closes it)."""
        request = self.client.build_request("POST", f"{url}{path}", json=body,
                                            headers=headers)
        try:
            return await self.client.send(request, stream=stream)
        except httpx.HTTPError as e:
            raise self.error(url, e) from None

    async def get(self, url: str, path: str, timeout: float | None = None) -> httpx.Response:
        try:
            return await self.client.get(f"{url}{path}", timeout=timeout or self.timeout)
        except httpx.HTTPError as e:
            raise self.error(url, e) from None

