"""MultiprocExecutor ("mp"): one worker process per rank on this machine.

Transport: one AF_UNIX socket per worker in a private 0700 directory, peers checked by pid;
messages are pickled, acceptable only because the channel is private to this user and machine
(mp_transport has the frames). torch.distributed meets at a `file://` store there and gloo
binds loopback; `<tmp>/interrupts` carries interrupt_step to a worker in a multi-step call.
Failures: a monitor thread waits on the workers' sentinels; a death records a
WorkerCrashedError, wakes the call in progress, kills the other workers and removes the
directory. Errors, timeouts and ranks out of step follow distributed.py.
Shutdown: shutdown(), GC, exit and SIGTERM stop, then kill, the workers; workers exit within
~1 s when the driver vanishes, and a group started later removes directories nobody holds.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import select
import socket
import sys
import time
import weakref
from typing import Any, NoReturn

import cloudpickle

from fleetllm.errors import (
    CommunicationTimeoutError,
    ConfigurationError,
    WorkerCrashedError,
    remote_error,
)
from fleetllm.executor import mp_transport as tr
from fleetllm.executor.abstract import RpcMethod
from fleetllm.executor.distributed import ERR, OK, RESYNC, DistributedExecutor, Reply
from fleetllm.executor.failures import step_timeout_message
from fleetllm.executor.mp_group import LIVE_GROUPS, WorkerGroup, install_sigterm_handler
from fleetllm.executor.mp_worker import worker_main


@contextlib.contextmanager
def _main_not_reimported():
    """Workers need nothing from the user's __main__. Spawn would re-run the user's script in
    every worker, which starts workers again unless the script is guarded by
    `if __name__ == "__main__":`; hiding the main module while starting them avoids that."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)


def _raise_if_start_error(rank: int, payload: bytes) -> int:
    """A startup reply's status; a START_ERR is raised as the worker's own exception."""
    _, status, value = pickle.loads(payload)
    if status == tr.START_ERR:
        exc, tb = tr.load_error(value)
        raise remote_error(rank, exc, f"(during worker startup)\n{tb}")
    return status


class MultiprocExecutor(DistributedExecutor):
    supports_pp = True

    def _init_executor(self) -> None:
        self._init_failure_state()
        pc = self.parallel_config
        self.world_size = pc.world_size
        if self.device_config.device == "cuda":
            import torch

            if torch.cuda.device_count() < self.world_size:
                raise ConfigurationError(
                    f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} "
                    f"workers, but only {torch.cuda.device_count()} CUDA devices are visible")
        self._call_id = 0
        self._group = group = WorkerGroup(self.world_size)
        self._finalizer = weakref.finalize(self, group.close)
        LIVE_GROUPS.add(group)
        install_sigterm_handler()
        try:
            self._start_workers(pc.startup_timeout)
        except BaseException:
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
        # cloudpickle: a config may name classes defined in the user's script, which the
        # workers do not import (see _main_not_reimported).
        config = cloudpickle.dumps(self.config)
        with _main_not_reimported():
            for rank in range(self.world_size):
                p = mp.Process(target=worker_main, name=f"fleetllm-worker-{rank}", daemon=True,
                               args=(rank, self.world_size, config, g.sock_path, init_method,
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
            if g.notify_r in events:  # a worker died: its own START_ERR explains it better
                self._raise_start_error_of_dead_ranks(conns)
                self._raise_if_unusable()
            if g.listener.fileno() in events:
                conn, _ = g.listener.accept()
                rank = next((r for r, p in enumerate(g.procs) if p.pid == tr.peer_pid(conn)
                             and conns[r] is None), None)
                if rank is None:  # not one of our workers: never unpickle what it sends
                    conn.close()
                    continue
                conn.settimeout(max(1.0, left_ms() / 1000))
                hello = tr.recv_frame(conn)
                conn.settimeout(None)
                expected = (tr.HELLO, (rank, g.procs[rank].pid))
                if hello is None or pickle.loads(hello)[1:] != expected:
                    conn.close()
                    continue
                conns[rank], g.pids[rank] = conn, g.procs[rank].pid
        g.channel = ch = tr.DriverChannel(conns, g.notify_r)
        # 2. each worker reports READY, or START_ERR with its traceback
        while len(ready) < self.world_size:
            woke = ch.poll(left_ms())
            if woke:
                ch.poll(0)  # a START_ERR already sent explains the death better
            for rank, payload in ch.inbox:
                if payload is None:
                    continue
                if _raise_if_start_error(rank, payload) == tr.READY:
                    ready.add(rank)
            ch.inbox.clear()
            if woke:
                self._raise_if_unusable()
        g.started = True

    def _raise_start_error_of_dead_ranks(self, conns: list[socket.socket | None]) -> None:
        """Raise the START_ERR a connected, now dead worker sent, if it did. Needed when a
        death is noticed while other ranks are still connecting (a slow machine): the
        monitor's WorkerCrashedError would otherwise hide the cause."""
        for rank, conn in enumerate(conns):
            if conn is None or self._group.procs[rank].is_alive():
                continue  # a live rank's READY must stay unread
            conn.settimeout(0.5)  # the dead worker wrote its frame whole before exiting
            try:
                frame = tr.recv_frame(conn)
            except OSError:
                continue
            if frame is not None:
                _raise_if_start_error(rank, frame)

    # ------------------------------------------------------------------ transport and failure

    def _raise_if_unusable(self) -> None:
        g = self._group
        if g.failure is not None and self._failure is None:
            self._failure = g.failure  # the monitor saw a worker die
        super()._raise_if_unusable()
        if g.channel is not None and g.channel.broken:
            raise WorkerCrashedError("a call was interrupted while sending a message, which "
                                     "left the channel unusable; create a new executor")

    def _await_failure(self, rank: int) -> NoReturn:
        """A worker's channel hung up: give the monitor up to 1 s to name the cause."""
        g = self._group
        end = time.monotonic() + 1.0
        while g.failure is None and time.monotonic() < end:
            select.select([g.notify_r], [], [], max(0.0, end - time.monotonic()))
        self._raise_if_unusable()
        self._crashed(WorkerCrashedError(f"worker rank {rank} closed its channel "
                                         "unexpectedly", rank=rank))

    def _stop_workers(self) -> None:
        self._group.fail(self._failure)

    def _send(self, method: RpcMethod, args: tuple, kwargs: dict[str, Any] | None,
              step: bool, deadline: float | None) -> int:
        ch = self._group.channel
        self._call_id += 1
        out = self.output_rank if step else -1
        header = tr.HEADER.pack(self._call_id, tr.EXEC if step else tr.CALL, out)
        body = tr.dumps_call(method, args, kwargs)
        for rank in range(self.world_size):
            try:
                ch.send(rank, header, body, deadline=deadline)
            except TimeoutError as e:  # (an OSError too: caught first)
                self._encoder.need_reset = True
                if step:
                    timeout = self.parallel_config.execute_model_timeout
                    self._hung(step_timeout_message([rank], timeout), [rank], e)
                raise CommunicationTimeoutError(
                    f"collective_rpc: {e} before its deadline; the channel is unusable, "
                    "create a new executor") from e
            except OSError:
                self._encoder.need_reset = True  # some ranks missed this message
                self._await_failure(rank)
            except BaseException:  # e.g. KeyboardInterrupt between two ranks' sends
                self._encoder.need_reset = True
                raise
        return self._call_id

    def _replies(self, call_id: int, timeout: float | None) -> list[Reply]:
        ch = self._group.channel
        if not ch.inbox:
            ch.poll(None if timeout is None else timeout * 1000)
        replies: list[Reply] = []
        for rank, payload in ch.inbox:
            if payload is None:  # EOF: the worker is gone
                ch.inbox.clear()
                self._await_failure(rank)
            cid, status, value = pickle.loads(payload)
            if cid != call_id:
                continue  # a late reply to a call that timed out or failed: dropped
            if status == tr.OK:
                replies.append((rank, OK, value))
            elif status == tr.ACK:
                replies.append((rank, OK, None))
            elif status == tr.RESYNC:
                replies.append((rank, RESYNC, None))
            else:
                err, entered = value
                exc, tb = tr.load_error(err)
                replies.append((rank, ERR, (remote_error(rank, exc, tb), err[1], err[2],
                                            entered)))
        ch.inbox.clear()
        return replies

    def interrupt_step(self) -> None:
        self._group.interrupts.bump()  # the output rank reads the shared file between passes

    def _shutdown(self) -> None:
        self._finalizer()  # runs group.close() once
