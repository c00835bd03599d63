"""MultiprocExecutor ("mp"): one worker process per rank on this machine.

Transport: one AF_UNIX stream socket per worker; the driver listens on `<tmp>/rpc` where <tmp>
is a private directory made with mode 0700, and checks each connecting peer's pid. Messages
are pickled (callables with cloudpickle): acceptable only because the channel is private to
this user and machine; never a TCP socket. torch.distributed rendezvous uses a `file://` store
in the same directory and gloo binds loopback only (GLOO_SOCKET_IFNAME=lo). See mp_transport
for the frame format (and why not zmq) and mp_delta for the delta encoding of execute_model.

Failure handling: a monitor thread waits on every worker's process sentinel. When one dies it
records a WorkerCrashedError, wakes any call in progress through a pipe the call also polls,
kills the remaining workers and removes the temp dir. Every later call raises the same error.

Shutdown: shutdown(), garbage collection and interpreter exit (weakref.finalize) ask the
workers to exit, then terminate and kill them. SIGTERM of the driver (when it had the default
handler) cleans up, then dies by SIGTERM as before. Workers ignore SIGINT (the driver's
KeyboardInterrupt unwinds into the finalizer) and exit by themselves within ~1 s when their
parent disappears (SIGKILL of the driver).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import select
import shutil
import signal
import socket
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import wait as wait_sentinels
from typing import Any

from fleetllm.errors import (
    CommunicationTimeoutError,
    ConfigurationError,
    WorkerCrashedError,
    remote_error,
)
from fleetllm.executor import mp_transport as tr
from fleetllm.executor.abstract import Executor, RpcMethod
from fleetllm.executor.mp_delta import DeltaEncoder
from fleetllm.executor.mp_worker import worker_main
from fleetllm.sequence import ExecuteModelRequest, SamplerOutput

ERROR_GRACE_S = 0.05  # after a first error, how long to wait for the other ranks' replies
EXIT_GRACE_S = 5.0  # shutdown: how long workers get to exit before SIGTERM, then SIGKILL

_LIVE_GROUPS: weakref.WeakSet[_WorkerGroup] = weakref.WeakSet()


class _Resync(Exception):
    """Workers could not decode a delta-encoded request: send it again in full."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown exit status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _private_tmpdir() -> str:
    # ipc:// paths are limited to ~107 bytes: fall back to /tmp when $TMPDIR is deep.
    base = tempfile.gettempdir()
    if len(base) > 60:
        base = "/tmp"
    return tempfile.mkdtemp(prefix="fleetllm-mp-", dir=base)  # mode 0700


class _WorkerGroup:
    """The worker processes and channels. Referenced by the monitor thread, the finalizer and
    the SIGTERM handler, never the executor itself, so the executor can be garbage collected."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.tmpdir = _private_tmpdir()
        self.sock_path = os.path.join(self.tmpdir, "rpc")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.sock_path)
        os.chmod(self.sock_path, 0o600)
        self.listener.listen(world_size)
        self.channel: tr.DriverChannel | None = None
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.pids: list[int | None] = [None] * world_size
        self.failure: WorkerCrashedError | None = None
        self.started = False
        self.closing = False
        self.lock = threading.Lock()
        self.proc_lock = threading.Lock()
        self.notify_r, self.notify_w = os.pipe()  # monitor -> a call waiting for replies
        self.stop_r, self.stop_w = os.pipe()  # close -> monitor
        self.monitor: threading.Thread | None = None

    def start_monitor(self) -> None:
        self.monitor = threading.Thread(target=self._monitor, name="fleetllm-mp-monitor",
                                        daemon=True)
        self.monitor.start()

    def _monitor(self) -> None:
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs)}
        ready = wait_sentinels([*by_sentinel, self.stop_r])
        if self.closing or self.stop_r in ready:
            return
        rank = min(by_sentinel[s] for s in ready if s in by_sentinel)
        proc = self.procs[rank]
        proc.join(1.0)
        when = "" if self.started else " during startup"
        self.failure = WorkerCrashedError(
            f"worker rank {rank} (pid {proc.pid}) died unexpectedly{when} with "
            f"{_describe_exit(proc.exitcode)}; the executor is unusable, create a new one",
            rank=rank, exitcode=proc.exitcode)
        os.write(self.notify_w, b"!")
        self.stop_processes(grace=0.0)
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def stop_processes(self, grace: float) -> None:
        """Wait `grace` seconds for the workers to exit, then SIGTERM, then SIGKILL."""
        with self.proc_lock:
            deadline = time.monotonic() + grace
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
            for p in self.procs:
                if p.is_alive():
                    p.terminate()
            deadline = time.monotonic() + 2.0
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
            for p in self.procs:
                if p.is_alive():
                    p.kill()
                    p.join(5.0)

    def close(self, polite: bool = True) -> None:
        """Idempotent. polite: ask the workers to exit first (not from a signal handler, which
        may have interrupted a half-sent message)."""
        with self.lock:
            if self.closing:
                return
            self.closing = True
        _LIVE_GROUPS.discard(self)
        os.write(self.stop_w, b"!")
        if polite and self.failure is None and self.channel is not None:
            header = tr.HEADER.pack(0, tr.EXIT, -1)
            for r, p in enumerate(self.procs):
                if p.is_alive():
                    try:
                        self.channel.conns[r].send(tr.frame_bytes(header))
                    except OSError:
                        pass
        self.stop_processes(grace=EXIT_GRACE_S if polite else 0.0)
        if self.monitor is not None and self.monitor is not threading.current_thread():
            self.monitor.join(5.0)
        if self.channel is not None:
            self.channel.close()
        self.listener.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        for fd in (self.notify_r, self.notify_w, self.stop_r, self.stop_w):
            try:
                os.close(fd)
            except OSError:
                pass


def _on_sigterm(signum: int, frame: Any) -> None:
    for group in list(_LIVE_GROUPS):
        group.close(polite=False)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm_handler() -> None:
    """Only over the default action and only from the main thread: never a user's handler."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


class MultiprocExecutor(Executor):
    supports_pp = True
    delta_encoding = True  # set False (class or instance) to send full requests every step

    def _init_executor(self) -> None:
        pc = self.parallel_config
        self.world_size = pc.world_size
        self.output_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
        if self.device_config.device == "cuda":
            import torch

            if torch.cuda.device_count() < self.world_size:
                raise ConfigurationError(
                    f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} "
                    f"workers, but only {torch.cuda.device_count()} CUDA devices are visible")
        self._call_id = 0
        self._encoder = DeltaEncoder()
        self._group = group = _WorkerGroup(self.world_size)
        self._finalizer = weakref.finalize(self, group.close)
        _LIVE_GROUPS.add(group)
        _install_sigterm_handler()
        try:
            self._start_workers(pc.startup_timeout)
        except BaseException:
            self._is_shutdown = True
            self._finalizer.detach()
            group.close(polite=False)
            raise

    @property
    def worker_pids(self) -> list[int | None]:
        return list(self._group.pids)

    @property
    def tmpdir(self) -> str:
        return self._group.tmpdir

    def _start_workers(self, startup_timeout: float) -> None:
        g = self._group
        mp = multiprocessing.get_context("spawn")
        init_method = f"file://{g.tmpdir}/dist_store"
        for rank in range(self.world_size):
            p = mp.Process(target=worker_main, name=f"fleetllm-worker-{rank}", daemon=True,
                           args=(rank, self.world_size, self.config, g.sock_path, init_method,
                                 os.getpid()))
            p.start()
            g.procs.append(p)
        g.start_monitor()
        deadline = time.monotonic() + startup_timeout

        def left_ms() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(self.world_size) if r not in ready]
                raise CommunicationTimeoutError(
                    f"worker ranks {missing} did not finish starting (connect, init_device, "
                    f"load_model) within startup_timeout={startup_timeout}s")
            return left * 1000

        # 1. every worker connects and says who it is (checked against the pid we started)
        ready: set[int] = set()
        conns: list[socket.socket | None] = [None] * self.world_size
        poller = select.poll()
        poller.register(g.listener.fileno(), select.POLLIN)
        poller.register(g.notify_r, select.POLLIN)
        while any(c is None for c in conns):
            events = dict(poller.poll(left_ms()))
            if g.notify_r in events:
                self._raise_if_unusable()
            if g.listener.fileno() in events:
                conn, _ = g.listener.accept()
                conn.settimeout(max(1.0, left_ms() / 1000))
                hello = tr.recv_frame(conn)
                conn.settimeout(None)
                _, status, (rank, pid) = pickle.loads(hello) if hello else (0, -1, (-1, 0))
                if (status != tr.HELLO or not 0 <= rank < self.world_size
                        or conns[rank] is not None or tr.peer_pid(conn) != g.procs[rank].pid):
                    conn.close()  # not one of ours
                    continue
                conns[rank], g.pids[rank] = conn, pid
        g.channel = ch = tr.DriverChannel(conns, g.notify_r)
        # 2. each worker reports READY, or START_ERR with its traceback
        while len(ready) < self.world_size:
            woke = ch.poll(left_ms())
            if woke:
                ch.poll(0)  # a START_ERR already sent explains the death better
            for rank, payload in ch.inbox:
                if payload is None:
                    continue
                _, status, value = pickle.loads(payload)
                if status == tr.READY:
                    ready.add(rank)
                elif status == tr.START_ERR:
                    exc, tb = tr.load_error(value)
                    raise remote_error(rank, exc, f"(during worker startup)\n{tb}")
            ch.inbox.clear()
            if woke:
                self._raise_if_unusable()
        g.started = True

    # ------------------------------------------------------------------------------ calls

    def _raise_if_unusable(self) -> None:
        g = self._group
        if g.failure is not None:
            f = g.failure
            raise WorkerCrashedError(f.args[0], rank=f.rank, exitcode=f.exitcode)
        if g.closing:
            raise WorkerCrashedError("the executor is shut down")

    def _await_failure(self, rank: int) -> None:
        """A worker's channel hung up: give the monitor up to 1 s to name the cause."""
        g = self._group
        end = time.monotonic() + 1.0
        while g.failure is None and time.monotonic() < end:
            select.select([g.notify_r], [], [], max(0.0, end - time.monotonic()))
        self._raise_if_unusable()
        raise WorkerCrashedError(f"worker rank {rank} closed its channel unexpectedly",
                                 rank=rank)

    def _call(self, kind: int, method: RpcMethod, args: tuple, kwargs: dict[str, Any] | None,
              timeout: float | None, unique_reply_rank: int | None,
              return_exceptions: bool) -> list[Any]:
        self._raise_if_unusable()
        ch = self._group.channel
        self._call_id += 1
        call_id = self._call_id
        header = tr.HEADER.pack(call_id, kind, -1 if unique_reply_rank is None
                                else unique_reply_rank)
        body = tr.dumps_call(method, args, kwargs)
        deadline = None if timeout is None else time.monotonic() + timeout
        for rank in range(self.world_size):
            try:
                ch.send(rank, header, body)
            except OSError:
                self._encoder.need_reset = True  # some ranks missed this message
                self._await_failure(rank)
        return self._gather(call_id, method, deadline, return_exceptions)

    def _gather(self, call_id: int, method: RpcMethod, deadline: float | None,
                return_exceptions: bool) -> list[Any]:
        ch = self._group.channel
        n = self.world_size
        results: list[Any] = [None] * n
        done = [False] * n
        pending = n
        errors: dict[int, BaseException] = {}
        resync = False
        error_deadline = None
        while pending:
            for rank, payload in ch.inbox:
                if payload is None:
                    ch.inbox.clear()
                    self._await_failure(rank)
                cid, status, value = pickle.loads(payload)
                if cid != call_id or done[rank]:
                    continue  # a late reply to a call that timed out or failed: drop it
                done[rank] = True
                pending -= 1
                if status == tr.OK:
                    results[rank] = value
                elif status == tr.ERR:
                    exc, tb = tr.load_error(value)
                    errors[rank] = remote_error(rank, exc, tb)
                elif status == tr.RESYNC:
                    resync = True
            ch.inbox.clear()
            if errors and not return_exceptions and not resync and error_deadline is None:
                error_deadline = time.monotonic() + ERROR_GRACE_S
            self._raise_if_unusable()
            if not pending:
                break
            now = time.monotonic()
            ends = [t for t in (deadline, error_deadline) if t is not None]
            if ends and min(ends) <= now:
                break
            ch.poll(None if not ends else (min(ends) - now) * 1000)
        if resync and not pending:
            raise _Resync()
        if errors and not return_exceptions:
            raise errors[min(errors)]
        if pending:
            name = method if isinstance(method, str) else getattr(method, "__name__", "callable")
            missing = [r for r in range(n) if not done[r]]
            raise CommunicationTimeoutError(
                f"collective_rpc({name!r}) got no reply from worker ranks {missing} in time")
        for r, e in errors.items():
            results[r] = e
        return results

    def collective_rpc(self, method: RpcMethod, timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None,
                       return_exceptions: bool = False) -> list[Any]:
        return self._call(tr.CALL, method, tuple(args), kwargs, timeout, None,
                          return_exceptions)

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> list[SamplerOutput]:
        rank = self.output_rank
        if not self.delta_encoding:
            return self._call(tr.CALL, "execute_model", (execute_model_req,), None, None, rank,
                              False)[rank]
        encoded = self._encoder.encode(execute_model_req)
        try:
            return self._call(tr.EXEC, "execute_model", (encoded,), None, None, rank,
                              False)[rank]
        except _Resync:
            encoded = self._encoder.encode(execute_model_req, full=True)
            return self._call(tr.EXEC, "execute_model", (encoded,), None, None, rank,
                              False)[rank]

    def _shutdown(self) -> None:
        self._finalizer()  # runs group.close() once
