"""MultiprocExecutor ("mp"): one worker process per rank on this machine.

Transport: one AF_UNIX stream socket per worker; the driver listens on `<tmp>/rpc` where <tmp>
is a private directory made with mode 0700, and checks each connecting peer's pid. Messages
are pickled (callables with cloudpickle): acceptable only because the channel is private to
this user and machine; never a TCP socket. torch.distributed rendezvous uses a `file://` store
in the same directory and gloo binds loopback only (GLOO_SOCKET_IFNAME=lo). See mp_transport
for the frame format (and why not zmq) and fleetllm.worker.delta for the delta encoding of
execute_model.

Failure handling: a monitor thread waits on every worker's process sentinel. When one dies it
records a WorkerCrashedError, wakes any call in progress through a pipe the call also polls,
kills the remaining workers and removes the temp dir. Every later call raises the same error.

execute_model is stricter than collective_rpc (the rules are failures.py's, shared with ray):
- A worker exception fails the executor: the driver stops every worker (terminates it: one in a
  collective cannot be told to exit), removes the temp dir and raises WorkerCrashedError naming
  the first rank to fail, with its remote traceback (the remote error is the __cause__), unless
  every rank raised the same error before any collective: then the executor stays usable and
  the call raises the remote error.
- No reply within ParallelConfig.execute_model_timeout raises CommunicationTimeoutError and
  fails the executor likewise (_exec_timed_out decides). Only process-based backends enforce
  it: 'uni' runs the step in the caller's process and cannot interrupt it.
- After any failed execute_model the delta encoder resends full data (need_reset).
Later calls raise WorkerCrashedError on a failed executor; after shutdown() EngineShutdownError,
even if it had failed before (not a crash to restart from).

Shutdown: shutdown(), garbage collection and interpreter exit (weakref.finalize) ask the
workers to exit, then terminate and kill them. SIGTERM of the driver (when it had the default
handler) cleans up, then dies by SIGTERM as before. Workers ignore SIGINT (the driver's
KeyboardInterrupt unwinds into the finalizer) and exit by themselves within ~1 s when their
parent disappears (SIGKILL of the driver).
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
    EngineShutdownError,
    WorkerCrashedError,
    remote_error,
)
from fleetllm.executor import mp_transport as tr
from fleetllm.executor.abstract import Executor, RpcMethod
from fleetllm.executor.failures import (
    ERROR_GRACE_S,
    EXEC_ERROR_GRACE_S,
    out_of_step,
    pending_ranks,
    step_failed_error,
    step_outstanding_message,
    step_timeout_message,
)
from fleetllm.executor.mp_group import (
    LIVE_GROUPS,
    WorkerGroup,
    install_sigterm_handler,
)
from fleetllm.executor.mp_worker import worker_main
from fleetllm.sequence import ExecuteModelRequest, SamplerOutput
from fleetllm.worker.delta import DeltaEncoder


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


class _Resync(Exception):
    """Workers could not decode a delta-encoded request: send it again in full."""


class MultiprocExecutor(Executor):
    supports_pp = True
    delta_encoding = True  # set False (class or instance) to send full requests every step

    def _init_executor(self) -> None:
        pc = self.parallel_config
        self.world_size = pc.world_size
        if self.device_config.device == "cuda":
            import torch

            if torch.cuda.device_count() < self.world_size:
                raise ConfigurationError(
                    f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} "
                    f"workers, but only {torch.cuda.device_count()} CUDA devices are visible")
        self._call_id = 0
        self._timed_out_step = None  # (call_id, results, done): failures.py
        self._encoder = DeltaEncoder()
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
            if g.notify_r in events:
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
        super()._raise_if_unusable()
        g = self._group
        if g.closing:  # the user's shutdown stands over an earlier failure: no restart wanted
            earlier = "" if g.failure is None else \
                f" (it had failed before: {g.failure.args[0].splitlines()[0]})"
            raise EngineShutdownError(f"the executor is shut down{earlier}; create a new one")
        if g.failure is not None:
            f = g.failure
            raise WorkerCrashedError(f.args[0], rank=f.rank, exitcode=f.exitcode)
        if g.channel is not None and g.channel.broken:
            raise WorkerCrashedError("a call was interrupted while sending a message, which "
                                     "left the channel unusable; create a new executor")

    def _await_failure(self, rank: int) -> None:
        """A worker's channel hung up: give the monitor up to 1 s to name the cause."""
        g = self._group
        end = time.monotonic() + 1.0
        while g.failure is None and time.monotonic() < end:
            select.select([g.notify_r], [], [], max(0.0, end - time.monotonic()))
        self._raise_if_unusable()
        raise WorkerCrashedError(f"worker rank {rank} closed its channel unexpectedly",
                                 rank=rank)

    def _fail(self, error: WorkerCrashedError) -> None:
        """Give up on the workers: every later call raises `error` (see WorkerGroup.fail)."""
        self._encoder.need_reset = True
        self._group.fail(error)

    def _call(self, kind: int, method: RpcMethod, args: tuple, kwargs: dict[str, Any] | None,
              timeout: float | None, unique_reply_rank: int | None,
              return_exceptions: bool, exec_call: bool = False) -> list[Any]:
        # The timeout covers waiting for the channel too (a step may hold it).
        with self._exclusive(timeout):
            return self._call_locked(kind, method, args, kwargs, timeout, unique_reply_rank,
                                     return_exceptions, exec_call)

    def _call_locked(self, kind: int, method: RpcMethod, args: tuple,
                     kwargs: dict[str, Any] | None, timeout: float | None,
                     unique_reply_rank: int | None, return_exceptions: bool,
                     exec_call: bool) -> list[Any]:
        if self._timed_out_step is not None:  # not waited for: give up on the workers
            _, _, done = self._timed_out_step
            self._timed_out_step = None
            what = step_timeout_message(pending_ranks(done),
                                        self.parallel_config.execute_model_timeout)
            self._fail(WorkerCrashedError(f"{what}; the step was not waited for again, so the "
                                          "workers were stopped: create a new executor"))
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
                ch.send(rank, header, body, deadline=deadline)
            except TimeoutError as e:  # (an OSError too: caught first)
                self._encoder.need_reset = True
                if exec_call:
                    self._exec_timed_out([rank], timeout, e)
                raise CommunicationTimeoutError(
                    f"collective_rpc: {e} within timeout={timeout}s; the channel is unusable, "
                    "create a new executor") from e
            except OSError:
                self._encoder.need_reset = True  # some ranks missed this message
                self._await_failure(rank)
            except BaseException:  # e.g. KeyboardInterrupt between two ranks' sends
                self._encoder.need_reset = True
                raise
        return self._gather(call_id, method, timeout, deadline, return_exceptions, exec_call)

    def _gather(self, call_id: int, method: RpcMethod, timeout: float | None,
                deadline: float | None, return_exceptions: bool, exec_call: bool,
                resume: tuple[list[Any], list[bool]] | None = None) -> list[Any]:
        """Collect call_id's replies. resume: (results, done) of a step that timed out once
        and is waited for again (wait_for_timed_out_step)."""
        ch = self._group.channel
        n = self.world_size
        results, done = resume or ([None] * n, [False] * n)
        pending = done.count(False)
        errors: dict[int, BaseException] = {}  # in order of arrival
        error_info: dict[int, tuple[str, str, bool]] = {}  # (type, message, entered collective)
        resync = False
        error_deadline = None
        grace = EXEC_ERROR_GRACE_S if exec_call else ERROR_GRACE_S
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
                    err, entered = value
                    exc, tb = tr.load_error(err)
                    errors[rank] = remote_error(rank, exc, tb)
                    error_info[rank] = (err[1], err[2], entered)
                elif status == tr.RESYNC:
                    resync = True
            ch.inbox.clear()
            if errors and not return_exceptions and not resync and error_deadline is None:
                error_deadline = time.monotonic() + grace
            if exec_call and errors:
                reason = out_of_step(error_info, done)
                if reason is not None:
                    self._exec_failed(errors, reason)
            if not pending:
                break
            self._raise_if_unusable()
            now = time.monotonic()
            ends = [t for t in (deadline, error_deadline) if t is not None]
            if ends and min(ends) <= now:
                break
            ch.poll(None if not ends else (min(ends) - now) * 1000)
        missing = [r for r in range(n) if not done[r]]
        if exec_call and errors and missing:
            self._exec_failed(errors, f"while ranks {missing} did not report the same error "
                                      "in time (presumably waiting in a collective operation)")
        if resync and not pending:
            raise _Resync()
        if errors and not return_exceptions:
            raise errors[min(errors)]
        if pending:
            if exec_call and resume is None:  # failures.py: the caller may wait once more
                self._timed_out_step = (call_id, results, done)
                raise CommunicationTimeoutError(step_outstanding_message(missing, timeout))
            if exec_call:
                self._exec_timed_out(missing, timeout)
            name = method if isinstance(method, str) else getattr(method, "__name__", "callable")
            raise CommunicationTimeoutError(
                f"collective_rpc({name!r}) got no reply from worker ranks {missing} in time")
        for r, e in errors.items():
            results[r] = e
        return results

    def _exec_failed(self, errors: dict[int, BaseException], reason: str) -> NoReturn:
        """An execute_model call failed in a way that may leave the ranks' collectives out of
        step: stop every worker and raise WorkerCrashedError naming the first rank to fail."""
        rank, remote = next(iter(errors.items()))
        error = step_failed_error(rank, remote, reason)
        self._fail(error)
        raise error from remote

    def _exec_timed_out(self, missing: list[int], timeout: float | None,
                        cause: BaseException | None = None) -> NoReturn:
        """Decide what to do with an execute_model call that ranks `missing` did not answer
        within execute_model_timeout. They are alive but stuck (in the model, or in a
        collective whose peer is gone), a collective cannot be interrupted, and the peers'
        next collectives would pair with the stuck ones: so today, stop every worker and fail
        the executor. (The place to add "wait once more, then restart the workers".)"""
        what = step_timeout_message(missing, timeout)
        self._fail(WorkerCrashedError(f"{what}; the workers were stopped and the executor is "
                                      "unusable: create a new one",
                                      rank=missing[0] if len(missing) == 1 else None))
        raise CommunicationTimeoutError(f"{what}; every worker was stopped, the executor is "
                                        "unusable: create a new one") from cause

    def collective_rpc(self, method: RpcMethod, timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None,
                       return_exceptions: bool = False) -> list[Any]:
        return self._call(tr.CALL, method, tuple(args), kwargs, timeout, None,
                          return_exceptions)

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> list[SamplerOutput]:
        if not self.delta_encoding:
            return self._exec(tr.CALL, execute_model_req)
        try:
            return self._exec(tr.EXEC, self._encoder.encode(execute_model_req))
        except _Resync:
            return self._exec(tr.EXEC, self._encoder.encode(execute_model_req, full=True))

    def _wait_timed_out_step(self) -> list[SamplerOutput]:
        call_id, results, done = self._timed_out_step
        self._timed_out_step = None
        timeout = self.parallel_config.execute_model_timeout
        try:
            return self._gather(call_id, "execute_model", timeout, time.monotonic() + timeout,
                                False, True, resume=(results, done))[self.output_rank]
        except BaseException:
            self._encoder.need_reset = True
            raise

    def _exec(self, kind: int, request: Any) -> list[SamplerOutput]:
        rank = self.output_rank
        try:
            return self._call(kind, "execute_model", (request,), None,
                              self.parallel_config.execute_model_timeout, rank, False,
                              exec_call=True)[rank]
        except _Resync:
            raise
        except BaseException:  # the workers may hold part of this step: resend in full
            self._encoder.need_reset = True
            raise

    def _shutdown(self) -> None:
        self._finalizer()  # runs group.close() once
