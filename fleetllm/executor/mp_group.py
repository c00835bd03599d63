"""Lifecycle of the "mp" worker processes: their private temp dir and listening socket, the
monitor thread that turns a dead worker into WorkerCrashedError, stopping the workers when the
driver fails the executor, and cleanup on shutdown, garbage collection, interpreter exit and
SIGTERM. See multiproc.py for the overview.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import wait as wait_sentinels
from typing import Any

from fleetllm.errors import WorkerCrashedError
from fleetllm.executor import mp_transport as tr
from fleetllm.worker.worker_base import StepInterrupts, interrupts_path

EXIT_GRACE_S = 5.0  # shutdown: how long workers get to exit before SIGTERM, then SIGKILL

LIVE_GROUPS: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()


def describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown exit status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _private_tmpdir() -> tuple[str, int]:
    """A new private (0700) dir for a worker group, and an open fd holding an exclusive lock
    on its `owner` file for as long as this process lives. Dirs left by dead owners are
    removed first: a driver SIGKILLed after making its dir but before its workers watch it
    (mp_worker._exit_if_orphaned; during a worker restart, say) leaves it behind, and the
    kernel releases a dead process's locks, whatever its pid namespace."""
    # AF_UNIX socket paths are limited to 107 bytes: use /tmp when $TMPDIR is deep.
    base = tempfile.gettempdir()
    if len(base) > 60:
        base = "/tmp"
    _remove_unowned_dirs(base)
    path = tempfile.mkdtemp(prefix="fleetllm-mp-", dir=base)
    fd = os.open(os.path.join(path, "owner.new"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # locked before a sweeper can see it under its name
    os.rename(os.path.join(path, "owner.new"), os.path.join(path, "owner"))
    return path, fd


def _remove_unowned_dirs(base: str) -> None:
    """Remove this user's fleetllm-mp-* dirs whose `owner` lock nobody holds (a dir without
    one is being made, or predates the lock: left alone)."""
    try:
        names = [n for n in os.listdir(base) if n.startswith("fleetllm-mp-")]
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(path, "owner"), os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its driver lives
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)


class WorkerGroup:
    """The worker processes and channels. Referenced by the monitor thread, the finalizer and
    the SIGTERM handler, never the executor itself, so the executor can be garbage collected."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.owner_pid = os.getpid()  # a forked copy of the driver must not touch the workers
        self.tmpdir, self.owner_fd = _private_tmpdir()
        self.sock_path = os.path.join(self.tmpdir, "rpc")
        self.interrupts = StepInterrupts(interrupts_path(self.tmpdir))  # the workers map it
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
        when = "" if self.started else " during startup (its traceback is on stderr)"
        with self.lock:  # fail() may have stopped the workers meanwhile: its cause stands
            if self.closing or self.failure is not None:
                return
            self.failure = WorkerCrashedError(
                f"worker rank {rank} (pid {proc.pid}) died unexpectedly{when} with "
                f"{describe_exit(proc.exitcode)}; the executor is unusable, create a new one",
                rank=rank, exitcode=proc.exitcode)
        os.write(self.notify_w, b"!")
        self.remove_dir_and_stop(grace=0.0)

    def fail(self, error: WorkerCrashedError) -> None:
        """The driver gave up on the workers (out of step or stuck in a call): record `error`
        for every later call, then stop the processes at once and remove the temp dir. A
        worker stuck in a collective cannot be told to exit: it is terminated."""
        with self.lock:
            if self.closing:
                return
            if self.failure is None:
                self.failure = error
            os.write(self.stop_w, b"!")  # these exits are ours: the monitor stands down
        self.remove_dir_and_stop(grace=0.0)

    def remove_dir_and_stop(self, grace: float) -> None:
        """The temp dir first: stopping the workers can take seconds, and a driver SIGKILLed
        meanwhile would leave it behind (a SIGTERMed worker does not remove it either)."""
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        self.stop_processes(grace)

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
            if self.closing or os.getpid() != self.owner_pid:
                return
            self.closing = True
        LIVE_GROUPS.discard(self)
        os.write(self.stop_w, b"!")
        ch = self.channel
        if polite and self.failure is None and ch is not None and not ch.broken:
            header = tr.HEADER.pack(0, tr.EXIT, -1)
            for r, p in enumerate(self.procs):
                if p.is_alive():
                    try:
                        ch.conns[r].send(tr.frame_bytes(header))
                    except OSError:
                        pass
        self.remove_dir_and_stop(grace=EXIT_GRACE_S if polite else 0.0)
        if self.monitor is not None and self.monitor is not threading.current_thread():
            self.monitor.join(5.0)
        if self.channel is not None:
            self.channel.close()
        self.listener.close()
        for fd in (self.notify_r, self.notify_w, self.stop_r, self.stop_w, self.owner_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    def kill_now(self) -> None:
        """From a signal handler: SIGKILL the workers and remove the temp dir, taking no lock
        (the code the signal interrupted may hold any of them: close() would deadlock)."""
        if os.getpid() != self.owner_pid:
            return
        for p in list(self.procs):
            try:
                if p.pid is not None:
                    os.kill(p.pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _on_sigterm(signum: int, frame: Any) -> None:
    """The driver dies by SIGTERM as the default action would, but takes its workers along.
    The process is ending: nothing is joined (the workers are reaped by whoever inherits
    them) and no lock is taken, so a SIGTERM that lands while a failure is being handled
    cannot deadlock on the handler's own thread."""
    for group in list(LIVE_GROUPS):
        group.kill_now()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def install_sigterm_handler() -> None:
    """Only over the default action and only from the main thread: never a user's handler."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
