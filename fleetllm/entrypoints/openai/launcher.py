"""`fleetllm serve`: start the engine, serve the app with uvicorn, drain on SIGTERM/SIGINT.

Drain: the first SIGTERM or SIGINT makes every new request (and /health) a 503, gives the
requests in flight up to --shutdown-timeout seconds to finish, ends the rest (a stream gets a
terminal error event, a plain request a 503), closes the listener, stops the engine and its
workers, and exits 0. A second signal skips the wait. uvicorn's own signal handling is
replaced: it would stop at once and then re-raise the signal, so the exit status would be the
signal's, not 0. A signal while the engine is still starting stops the start (the engine core
and its workers are killed) and exits 128 + the signal's number.
An engine core that died and could not be restarted (core_client: max_worker_restarts) stops
the server with exit status 1, for a supervisor to start it again, instead of a server that
answers 503 for ever.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import resource
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from fleetllm.engine.arg_utils import engine_kwargs_from, resolve_model
from fleetllm.engine.async_engine import AsyncLLMEngine
from fleetllm.engine.core_client import EngineCoreClient
from fleetllm.entrypoints.openai.api_server import HTTPOptions, build_app
from fleetllm.entrypoints.openai.gate import ServerState
from fleetllm.errors import ConfigurationError, EngineShutdownError

logger = logging.getLogger("fleetllm.serve")
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _handling_signals(handler: Callable[[int, object], None]) -> Iterator[None]:
    """handler for SIGINT and SIGTERM while inside, the previous ones after; on the main
    thread only, as signal handlers must be (elsewhere nothing is installed)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def signals_to_loop(on_signal: Callable[[int], None]) -> contextlib.AbstractContextManager[None]:
    """While inside: SIGINT and SIGTERM call on_signal(sig) on the running event loop, in place
    of uvicorn's handlers (which re-raise the signal after shutting down). `fleetllm serve`'s
    and `fleetllm proxy`'s servers."""
    loop = asyncio.get_running_loop()
    return _handling_signals(lambda sig, frame: loop.call_soon_threadsafe(on_signal, sig))


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, engine: AsyncLLMEngine,
                 shutdown_timeout: float):
        super().__init__(config)
        self.state = state
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._drain_task: asyncio.Task | None = None
        self.exit_code = 0

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return signals_to_loop(self._on_signal)

    def _on_signal(self, sig: int) -> None:
        if self._drain_task is None:
            logger.info("%s: draining (%d in flight, up to %.0f s)", signal.Signals(sig).name,
                        self.state.in_flight, self.shutdown_timeout)
            self._drain_task = asyncio.ensure_future(self._drain())
        else:
            logger.warning("second signal: ending the requests in flight now")
            self.shutdown_timeout = 0
            self._end_requests()

    async def _drain(self) -> None:
        self.state.draining = True
        try:
            await asyncio.wait_for(self.state.wait_idle(), self.shutdown_timeout)
        except TimeoutError:
            logger.warning("%d requests still in flight after %.0f s: ending them",
                           self.state.in_flight, self.shutdown_timeout)
            self._end_requests()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.state.wait_idle(), 5.0)
        self.should_exit = True

    def engine_died(self, error: BaseException) -> None:
        """The engine is dead for good (its streams have ended with the error): exit 1."""
        logger.error("the engine is dead and cannot be restarted: stopping the server (exit "
                     "status 1): %s", error)
        self.exit_code = 1
        self.state.draining = True
        self.should_exit = True

    def _end_requests(self) -> None:
        self.engine.abort_all(EngineShutdownError("the server is shutting down"))


def run_serve(args: argparse.Namespace) -> int:
    """The `fleetllm serve` command."""
    # force: `fleetllm` set up plain WARNING logging before this command ran, which would
    # otherwise hide --log-level info (the drain's and the open-file limit's lines).
    logging.basicConfig(level=args.log_level.upper(), force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ConfigurationError("--enable-auto-tool-choice needs --tool-call-parser")
    model = resolve_model(args.model_tag or args.model)
    chat_template = load_chat_template(args.chat_template)
    warn_if_exposed(args.host, args.api_key)
    engine_kwargs = engine_kwargs_from(args, args.engine_actions)
    check_lora_args(args, engine_kwargs)
    raise_open_file_limit()
    # The engine in a process of its own (core_proc), unless asked to keep it in this one.
    start = AsyncLLMEngine.from_engine_args if args.disable_frontend_multiprocessing \
        else EngineCoreClient
    with _signals_stop_the_start():
        engine = start(model, step_timeout_s=args.step_timeout, **engine_kwargs)
    try:
        state = ServerState()
        http = HTTPOptions(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                           args.allow_credentials, args.enable_request_id_headers)
        app = build_app(engine, args.served_model_name or [model], args.api_key,
                        chat_template, state, enable_sleep_mode=args.enable_sleep_mode,
                        http=http, enable_auto_tool_choice=args.enable_auto_tool_choice,
                        tool_call_parser=args.tool_call_parser, lora_modules=args.lora_modules,
                        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                        max_prompts_per_request=args.max_prompts_per_request)
        sock = bind_socket(args.host, args.port)
        host, port = sock.getsockname()[:2]
        # Tests and scripts wait for this line to learn the port (--port 0).
        print(f"fleetllm serve: listening on http://{url_host(host)}:{port}", flush=True)
        config = uvicorn.Config(app, log_level=args.log_level, access_log=args.access_log,
                                lifespan="off", timeout_graceful_shutdown=5,
                                timeout_keep_alive=5)
        server = DrainingServer(config, state, engine, args.shutdown_timeout)
        asyncio.run(_serve(server, app, sock))
    finally:
        engine.shutdown()
    logger.info("stopped")
    return server.exit_code


def _signals_stop_the_start() -> contextlib.AbstractContextManager[None]:
    """SIGTERM/SIGINT while the engine starts: SystemExit(128 + signal) in the main thread,
    which the engine's start unwinds (core_restart.start_core kills the core; its workers
    follow it), rather than dying at once and leaving them running."""

    def stop(sig: int, frame: object) -> None:
        logger.warning("%s while the engine was starting: stopping", signal.Signals(sig).name)
        raise SystemExit(128 + sig)

    return _handling_signals(stop)


async def _serve(server: DrainingServer, app: FastAPI, sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()

    def on_dead(error: BaseException) -> None:  # on the engine's own thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: stopping anyway
            loop.call_soon_threadsafe(server.engine_died, error)

    server.engine.on_dead = on_dead
    if server.engine.errored:
        server.engine_died(server.engine._fatal)
    # The --lora-modules adapters load before the server answers (on its event loop): a bad
    # one stops the start.
    await app.state.models.init_static_loras()
    await server.serve(sockets=[sock])


def check_lora_args(args: argparse.Namespace, engine_kwargs: dict) -> None:
    """The server's LoRA flags need the engine's (a ConfigurationError naming them)."""
    if engine_kwargs.get("enable_lora"):
        return
    for flag, given in (("--lora-modules", args.lora_modules),
                        ("--allow-runtime-lora-updating", args.allow_runtime_lora_updating)):
        if given:
            raise ConfigurationError(f"{flag} needs --enable-lora")


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard one (as vLLM does): every connection
    is a file, and at the common default of 1024, 2,000 clients made tens of thousands of
    accept errors and starved /health. Returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit still has the kernel's ceiling (nr_open): ask for 1M then.
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:
        logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
        return soft, soft
    logger.info("raised the open-file limit from %d to %d", soft, target)
    return soft, target


def warn_if_exposed(host: str, api_key: str | None) -> bool:
    """Log a warning (and return True) for a non-loopback address without an API key."""
    if api_key or is_loopback(host):
        return False
    logger.warning("listening on %s without --api-key: anyone who can reach this address can "
                   "use the model", host)
    return True


def load_chat_template(value: str | None) -> str | None:
    """A template file, or the template itself when it is not a file but looks like Jinja."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ConfigurationError(f"chat_template: no such file: {value}")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    # asyncio sets TCP_NODELAY only on sockets made with proto=IPPROTO_TCP, and this one has
    # proto 0: without it every reply after the first on a kept-alive connection waited
    # ~40 ms (Nagle's algorithm against the client's delayed ACK). Accepted sockets
    # inherit it.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
