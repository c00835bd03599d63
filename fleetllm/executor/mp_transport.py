"""Wire format and channels of the "mp" backend (driver <-> worker processes).

Security: messages are pickled (unpickling runs code), so they travel only on AF_UNIX sockets
in a 0700 temp directory, peers checked with SO_PEERCRED; never on TCP. Plain sockets, not
zmq, whose I/O threads made a round trip several times slower.
Frames: 8-byte little-endian length, then the payload. Driver -> worker: HEADER (call_id,
kind CALL | EXEC | EXIT, unique_reply_rank) + pickled (method, args, kwargs), the same bytes
for every rank; with unique_reply_rank >= 0 only that rank returns its result, the others an
ACK (errors always). Worker -> driver: pickled (call_id, status, value), status OK, ACK, ERR,
RESYNC, or at startup HELLO (rank, pid), READY, START_ERR. An ERR carries whether the rank
entered a collective, which says whether the other ranks can still be in step.
"""

from __future__ import annotations

import errno
import pickle
import select
import socket
import struct
import time
from typing import Any

import cloudpickle

from fleetllm.executor.failures import error_payload, load_error

__all__ = ["error_payload", "load_error"]  # re-exported: the mp modules call them tr.*

# message kinds (driver -> worker)
CALL, EXEC, EXIT = 0, 1, 2
# reply statuses (worker -> driver)
OK, ACK, ERR, RESYNC, HELLO, READY, START_ERR = range(7)

HEADER = struct.Struct("<qbq")  # call_id, kind, unique_reply_rank (-1: every rank replies)
_LEN = struct.Struct("<Q")
_CHUNK = 1 << 18


def dumps_call(method: Any, args: tuple, kwargs: dict | None) -> bytes:
    """The body of a call. Plain pickle when it can; cloudpickle for lambdas and closures."""
    msg = (method, args, kwargs)
    if isinstance(method, str):
        try:
            return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, AttributeError, TypeError):
            pass  # a lambda or local object among the arguments
    return cloudpickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def dumps_reply(call_id: int, status: int, value: Any) -> bytes:
    return pickle.dumps((call_id, status, value), protocol=pickle.HIGHEST_PROTOCOL)


def error_reply(exc: BaseException, entered_collective: bool) -> tuple[tuple, bool]:
    """The value of an ERR reply (see the module docstring)."""
    return error_payload(exc), entered_collective


# ------------------------------------------------------------------ blocking (worker) side


def send_frame(sock: socket.socket, *parts: bytes) -> None:
    """Send one frame made of `parts` (scatter-gather: big bodies are not copied)."""
    size = sum(len(p) for p in parts)
    bufs = [_LEN.pack(size), *parts]
    sent = sock.sendmsg(bufs)
    if sent < size + _LEN.size:  # the kernel took part of it: send the rest plainly
        rest = b"".join(bufs)[sent:]
        sock.sendall(rest)


def recv_frame(sock: socket.socket) -> bytearray | None:
    """One whole frame's payload; None at end of stream (the peer is gone)."""
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (size,) = _LEN.unpack(head)
    return _recv_exact(sock, size) if size else bytearray()


def _recv_exact(sock: socket.socket, size: int) -> bytearray | None:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            return None
        got += n
    return buf


# ----------------------------------------------------------------- non-blocking (driver) side


class DriverChannel:
    """One non-blocking socket per rank. Sends also drain what the workers write meanwhile, so
    a big request and a big late reply can never block each other."""

    def __init__(self, conns: list[socket.socket], wake_fd: int) -> None:
        self.conns = conns
        for c in conns:
            c.setblocking(False)
        self.bufs = [bytearray() for _ in conns]
        self.inbox: list[tuple[int, bytes | None]] = []  # (rank, payload or None at EOF)
        self.eof = [False] * len(conns)
        self.broken = False
        self.rank_of = {c.fileno(): r for r, c in enumerate(conns)}
        self.wake_fd = wake_fd
        self.poller = select.poll()
        for c in conns:
            self.poller.register(c.fileno(), select.POLLIN)
        self.poller.register(wake_fd, select.POLLIN)

    def send(self, rank: int, *parts: bytes, deadline: float | None = None) -> None:
        """Send one frame; past `deadline` (time.monotonic()) raise TimeoutError, leaving
        the channel broken (a frame was cut)."""
        conn = self.conns[rank]
        size = sum(len(p) for p in parts)
        bufs = [_LEN.pack(size), *parts]
        try:
            sent = conn.sendmsg(bufs)
        except BlockingIOError:
            sent = 0
        if sent == size + _LEN.size:
            return
        rest = memoryview(b"".join(bufs))[sent:]
        self.broken = True  # until the frame is complete: an interrupted send corrupts it
        while rest:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"worker rank {rank} stopped reading its channel")
            # wake at the deadline, not up to a second after it
            wait = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            ready = select.select([c for r, c in enumerate(self.conns) if not self.eof[r]],
                                  [conn], [], wait)
            for c in ready[0]:
                self._pump(self.rank_of[c.fileno()])
            if self.eof[rank]:
                raise ConnectionResetError(errno.ECONNRESET, f"worker rank {rank} hung up")
            if ready[1]:
                try:
                    rest = rest[conn.send(rest):]
                except BlockingIOError:
                    pass
        self.broken = False

    def poll(self, timeout_ms: float | None) -> bool:
        """Wait for replies (or the wake fd); move complete frames to the inbox. True when the
        wake fd fired."""
        woke = False
        for fd, _ in self.poller.poll(timeout_ms):
            if fd == self.wake_fd:
                woke = True
            else:
                self._pump(self.rank_of[fd])
        return woke

    def _pump(self, rank: int) -> None:
        conn, buf = self.conns[rank], self.bufs[rank]
        while True:
            try:
                chunk = conn.recv(_CHUNK)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.eof[rank] = True
                self.poller.unregister(conn.fileno())
                break
            buf += chunk
            if len(chunk) < _CHUNK:
                break
        self.inbox += [(rank, frame) for frame in take_frames(buf)]
        if self.eof[rank]:
            self.inbox.append((rank, None))

    def close(self) -> None:
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass


def take_frames(buf: bytearray) -> list[bytes]:
    """The payloads of the whole frames at the front of `buf`, removed from it (a partial
    frame stays for the next read)."""
    frames, pos = [], 0
    while len(buf) - pos >= _LEN.size:
        (size,) = _LEN.unpack_from(buf, pos)
        end = pos + _LEN.size + size
        if len(buf) < end:
            break
        frames.append(bytes(buf[pos + _LEN.size:end]))
        pos = end
    if pos:
        del buf[:pos]
    return frames


def peer_pid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def frame_bytes(*parts: bytes) -> bytes:
    """A whole frame as one bytes object (for small control messages)."""
    return b"".join([_LEN.pack(sum(len(p) for p in parts)), *parts])
