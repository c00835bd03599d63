"""The body of one "mp" worker process: connect, build the Worker, then serve calls.

Runs in a process started with the spawn context. Messages are pickled (see mp_transport for
why that is acceptable: the channel is a private AF_UNIX socket in a 0700 directory).
"""

from __future__ import annotations

import os
import pickle
import select
import shutil
import signal
import socket
import sys
import threading
import time
from typing import Any

import cloudpickle
import torch

from fleetllm.distributed import parallel_state
from fleetllm.executor import mp_transport as tr
from fleetllm.executor.kv_output import kv_connector_news
from fleetllm.worker.delta import DeltaDesync
from fleetllm.worker.worker_base import (
    StepInterrupts,
    WorkerWrapperBase,
    interrupts_path,
    run_method,
)

PARENT_CHECK_S = 1.0


def _exit_if_orphaned(parent_pid: int, tmpdir: str) -> None:
    """The driver is gone (SIGKILLed): nobody else will clean up, so remove the private temp
    dir (every worker tries; ignore_errors makes that safe) and exit at once."""
    if os.getppid() != parent_pid:
        shutil.rmtree(tmpdir, ignore_errors=True)
        os._exit(1)


def _watch_parent(parent_pid: int, tmpdir: str) -> None:
    """Exit when the driver is gone, even while a call is running. (Not PR_SET_PDEATHSIG: it
    fires when the *thread* that started us exits, e.g. an executor built in a worker thread.)
    """
    while True:
        time.sleep(PARENT_CHECK_S)
        _exit_if_orphaned(parent_pid, tmpdir)


def worker_main(rank: int, world_size: int, config_bytes: bytes, sock_path: str,
                init_method: str, parent_pid: int) -> None:
    # Ctrl-C in a terminal reaches the whole process group: let the driver decide and clean
    # up. SIGTERM keeps its default action (the driver uses it to stop a stuck worker).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # gloo (and NCCL's bootstrap) must only ever bind loopback; respect a user's choice.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    tmpdir = os.path.dirname(sock_path)
    threading.Thread(target=_watch_parent, args=(parent_pid, tmpdir),
                     name="fleetllm-parent-watch", daemon=True).start()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sock_path)

    def reply(call_id: int, status: int, value: Any) -> None:
        try:
            payload = tr.dumps_reply(call_id, status, value)
        except Exception:
            try:  # a lambda or local object in the result
                payload = cloudpickle.dumps((call_id, status, value))
            except Exception as e:  # an unpicklable result: report that instead
                payload = tr.dumps_reply(call_id, tr.ERR, tr.error_reply(
                    TypeError(f"rank {rank}: the result cannot be pickled: {e}"), False))
        tr.send_frame(sock, payload)

    reply(-1, tr.HELLO, (rank, os.getpid()))
    config = pickle.loads(config_bytes)  # cloudpickle output; private channel (see above)
    wrapper = WorkerWrapperBase(config, rpc_rank=rank)
    wrapper.interrupts = StepInterrupts(interrupts_path(tmpdir))  # the driver bumps it
    try:
        wrapper.init_worker(local_rank=rank, rank=rank, distributed_init_method=init_method,
                            is_driver_worker=rank == 0)
        wrapper.execute_method("init_device")
        wrapper.execute_method("load_model")
    except BaseException as e:
        reply(-1, tr.START_ERR, tr.error_payload(e))
        sock.close()
        _fast_exit(1)
    reply(-1, tr.READY, None)

    poller = select.poll()
    poller.register(sock, select.POLLIN)
    try:
        while True:
            if not poller.poll(PARENT_CHECK_S * 1000):  # idle: block, never spin
                _exit_if_orphaned(parent_pid, tmpdir)
                continue
            frame = tr.recv_frame(sock)
            if frame is None:  # the channel closed without EXIT: was the driver killed?
                end = time.monotonic() + 2.0
                while time.monotonic() < end:
                    _exit_if_orphaned(parent_pid, tmpdir)
                    time.sleep(0.05)
                break
            call_id, kind, unique = tr.HEADER.unpack_from(frame)
            if kind == tr.EXIT:
                break
            collectives_before = parallel_state.collective_count()
            try:
                method, args, kwargs = pickle.loads(memoryview(frame)[tr.HEADER.size:])
                if kind == tr.EXEC:
                    try:
                        result = wrapper.execute_model(args[0])
                    except DeltaDesync:  # raised before anything ran: nothing is out of step
                        reply(call_id, tr.RESYNC, None)
                        continue
                else:
                    result = run_method(wrapper.worker, method, args, kwargs or {})
            except BaseException as e:
                # The driver needs to know whether the peers' collectives are still in step.
                entered = parallel_state.collective_count() != collectives_before
                reply(call_id, tr.ERR, tr.error_reply(e, entered))
                continue
            if unique < 0 or unique == rank:
                reply(call_id, tr.OK, result)
            elif (news := kv_connector_news(result)) is not None:
                reply(call_id, tr.OK, news)  # a KV connector's: the executor merges all ranks'
            else:
                reply(call_id, tr.ACK, None)
    finally:
        try:
            if wrapper.worker is not None:
                wrapper.worker.shutdown()
        finally:
            sock.close()
            _fast_exit(0)


def _fast_exit(code: int) -> None:
    """Skip the interpreter's teardown, which takes ~2 s with torch loaded: the worker has
    released what it owns (process groups, socket) by now. (atexit hooks do not run.)"""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
