"""`fleetllm proxy`: its flags, and serving DisaggProxy's app with uvicorn.

How: binds --host (127.0.0.1 unless told; a warning when it is not a loopback address) and
--port (0: a free one), prints "fleetllm proxy: listening on URL" (tests and scripts wait for
that line), and serves until SIGTERM or SIGINT, which stop it with exit status 0 (uvicorn's
graceful shutdown: the requests in flight get up to --shutdown-timeout seconds).
What fails and how: a bad URL or a missing --prefill/--decode is a ConfigurationError before
anything binds; an address in use is the OSError of the bind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

import uvicorn

from fleetllm.entrypoints.openai.launcher import (
    bind_socket,
    is_loopback,
    signals_to_loop,
    url_host,
)
from fleetllm.entrypoints.proxy.app import DisaggProxy, build_proxy_app

logger = logging.getLogger("fleetllm.proxy")


def add_proxy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="the prefill instances (`fleetllm serve` with kv_role "
                        "kv_producer), e.g. http://127.0.0.1:8100; taken in turn")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="the decode instances (kv_role kv_consumer); taken in turn")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds an instance may take to answer (per chunk when "
                        "streaming) before the client gets a 504")
    parser.add_argument("--connect-timeout", type=float, default=10.0,
                        help="seconds to connect to an instance before the client gets a 504")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds the requests in flight get after SIGTERM")
    parser.add_argument("--log-level", default="warning",
                        choices=["debug", "info", "warning", "error"])


class _ProxyServer(uvicorn.Server):
    """uvicorn whose SIGTERM/SIGINT stop it with exit status 0 (uvicorn's own handlers
    re-raise the signal after shutting down)."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return signals_to_loop(self._stop)

    def _stop(self, sig: int) -> None:
        if self.should_exit:
            self.force_exit = True
        logger.info("%s: stopping", signal.Signals(sig).name)
        self.should_exit = True


def run_proxy(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    proxy = DisaggProxy(args.prefill, args.decode, args.timeout, args.connect_timeout)
    if not is_loopback(args.host):
        logger.warning("listening on %s: anyone who can reach this address can use the "
                       "instances behind the proxy", args.host)
    sock = bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    print(f"fleetllm proxy: listening on http://{url_host(host)}:{port}", flush=True)
    config = uvicorn.Config(build_proxy_app(proxy), log_level=args.log_level,
                            access_log=False, lifespan="off",
                            timeout_graceful_shutdown=int(args.shutdown_timeout),
                            timeout_keep_alive=5)

    async def serve() -> None:
        try:
            await _ProxyServer(config).serve(sockets=[sock])
        finally:
            await proxy.aclose()

    asyncio.run(serve())
    return 0
