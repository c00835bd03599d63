"""Wire format of the "mp" backend: messages between the driver and its worker processes.

Security note: messages are pickled (and callables sent with cloudpickle), which executes code
when loaded. That is only acceptable because every channel is private to this user and this
machine: zmq `ipc://` sockets inside a temp directory created with mode 0700 (plus pipes that
multiprocessing made). Never put these messages on a TCP socket or anything another user can
reach.

Driver -> worker, two frames per call, the same bytes to every rank: a fixed header
(call_id, kind, unique_reply_rank) packed with struct, and the pickled (method, args, kwargs).
  kind: CALL (run `method` on the worker), EXEC (execute_model; args[0] is an EncodedRequest)
  or EXIT. unique_reply_rank None: every rank replies with its result; an int: only that rank
  sends its result, the others send a tiny ACK on success (errors are always sent, so a
  failure on any rank surfaces in the same call).
Worker -> driver: (call_id, status, value), status one of OK, ACK, ERR, RESYNC, plus the
startup messages HELLO, READY and START_ERR with call_id -1.

Delta encoding (EXEC): a decode step must not resend whole token histories. The driver's
DeltaEncoder remembers, per seq_id, how many prompt/output tokens the workers already hold and
sends only the new output tokens (num_computed_tokens and block tables always go in full);
SamplingParams are sent once per request. Workers keep the same state in a DeltaDecoder and
rebuild full SequenceData objects. Every worker sees the same message stream, so all ranks'
caches are identical: if decoding fails on one it fails on all, before anything runs, and they
all answer RESYNC; the driver then resends the call with full data and a cache reset.
"""

from __future__ import annotations

import pickle
import struct
import traceback
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from fleetllm.sampling_params import SamplingParams
from fleetllm.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata

# message kinds (driver -> worker)
CALL, EXEC, EXIT = 0, 1, 2
# reply statuses (worker -> driver)
OK, ACK, ERR, RESYNC, HELLO, READY, START_ERR = range(7)

HEADER = struct.Struct("<qbq")  # call_id, kind, unique_reply_rank (-1: every rank replies)


def identity(rank: int) -> bytes:
    """The zmq identity of worker `rank` (zmq reserves identities starting with a zero byte)."""
    return b"w%d" % rank


# per-sequence entry kinds inside an EncodedRequest
_FULL, _DELTA = 0, 1


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


def error_payload(exc: BaseException) -> tuple[bytes | None, str, str, str]:
    """(pickled exception or None, type name, message, formatted traceback)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        blob = None
    return blob, type(exc).__name__, str(exc), tb


def load_error(payload: tuple[bytes | None, str, str, str]) -> tuple[BaseException, str]:
    """The worker's exception (or a stand-in when it cannot be unpickled here) and traceback."""
    blob, type_name, message, tb = payload
    if blob is not None:
        try:
            exc = pickle.loads(blob)
            if isinstance(exc, BaseException):
                return exc, tb
        except Exception:
            pass
    return RuntimeError(f"{type_name}: {message}"), tb


# ---------------------------------------------------------------------------- delta encoding


@dataclass
class EncodedRequest:
    """An ExecuteModelRequest with token histories replaced by deltas where possible."""

    # per group: (request_id, is_prompt, seqs, sampling_params or None, block_tables,
    #             token_chunk_size, do_sample); seqs: [(seq_id, kind, a, b, num_computed)]
    #   kind _FULL: a = prompt ids, b = output ids; _DELTA: a = None, b = new output ids
    groups: list[tuple]
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)
    num_lookahead_slots: int = 0
    running_queue_size: int | None = None
    finished_requests_ids: list[str] = field(default_factory=list)
    reset: bool = False  # workers clear their whole cache before decoding


class DeltaDesync(Exception):
    """The worker's cache does not match what the driver assumed: resend full data."""


class DeltaEncoder:
    """Driver side: what the workers hold, per seq id and per request id."""

    def __init__(self) -> None:
        # seq_id -> [request_id, prompt_len, output_len, last output token or None]
        self.seqs: dict[int, list] = {}
        self.req_seqs: dict[str, set[int]] = {}
        self.params: dict[str, SamplingParams] = {}
        self.need_reset = False

    def reset(self) -> None:
        """Forget everything: the next message resends full data and clears worker caches."""
        self.seqs.clear()
        self.req_seqs.clear()
        self.params.clear()
        self.need_reset = True

    def encode(self, req: ExecuteModelRequest, full: bool = False) -> EncodedRequest:
        if full:
            self.reset()
        reset, self.need_reset = self.need_reset, False
        for rid in req.finished_requests_ids:  # workers drop these before decoding the groups
            for sid in self.req_seqs.pop(rid, ()):
                self.seqs.pop(sid, None)
            self.params.pop(rid, None)
        groups = []
        for g in req.seq_group_metadata_list:
            rid = g.request_id
            known = self.params.get(rid)
            if known is not None and (known is g.sampling_params or known == g.sampling_params):
                params = None
            else:
                params = self.params[rid] = g.sampling_params
            seqs = []
            for sid, data in g.seq_data.items():
                prompt, out = data.prompt_token_ids, data.output_token_ids
                st = self.seqs.get(sid)
                if (st is not None and st[0] == rid and st[1] == len(prompt)
                        and st[2] <= len(out)
                        and (st[2] == 0 or out[st[2] - 1] == st[3])):
                    seqs.append((sid, _DELTA, None, out[st[2]:], data.num_computed_tokens))
                else:
                    seqs.append((sid, _FULL, list(prompt), list(out), data.num_computed_tokens))
                    if st is not None and st[0] != rid:
                        self.req_seqs.get(st[0], set()).discard(sid)
                    st = self.seqs[sid] = [rid, len(prompt), 0, None]
                    self.req_seqs.setdefault(rid, set()).add(sid)
                st[2] = len(out)
                st[3] = out[-1] if out else None
            groups.append((rid, g.is_prompt, seqs, params, g.block_tables, g.token_chunk_size,
                           g.do_sample))
        return EncodedRequest(groups, req.blocks_to_swap_in, req.blocks_to_swap_out,
                              req.blocks_to_copy, req.num_lookahead_slots,
                              req.running_queue_size, list(req.finished_requests_ids), reset)


class DeltaDecoder:
    """Worker side: per-seq SequenceData caches, rebuilt into full requests."""

    def __init__(self) -> None:
        self.seqs: dict[int, tuple[str, list[int], list[int]]] = {}  # id -> (rid, prompt, out)
        self.req_seqs: dict[str, set[int]] = {}
        self.params: dict[str, SamplingParams] = {}

    def clear(self) -> None:
        self.seqs.clear()
        self.req_seqs.clear()
        self.params.clear()

    def decode(self, enc: EncodedRequest) -> ExecuteModelRequest:
        if enc.reset:
            self.clear()
        for rid in enc.finished_requests_ids:
            for sid in self.req_seqs.pop(rid, ()):
                self.seqs.pop(sid, None)
            self.params.pop(rid, None)
        # Validate everything before changing anything: a desync leaves the cache untouched
        # on every rank alike, and nothing has run.
        for rid, _, seqs, params, *_ in enc.groups:
            if params is None and rid not in self.params:
                raise DeltaDesync(f"no sampling params cached for request {rid!r}")
            for sid, kind, _, _, _ in seqs:
                if kind == _DELTA and (sid not in self.seqs or self.seqs[sid][0] != rid):
                    raise DeltaDesync(f"sequence {sid} of request {rid!r} is not cached")
        groups = []
        for rid, is_prompt, seqs, params, tables, chunk, do_sample in enc.groups:
            if params is None:
                params = self.params[rid]
            else:
                self.params[rid] = params
            seq_data = {}
            for sid, kind, a, b, computed in seqs:
                if kind == _DELTA:
                    _, prompt, out = self.seqs[sid]
                    out.extend(b)
                else:
                    old = self.seqs.get(sid)
                    if old is not None and old[0] != rid:
                        self.req_seqs.get(old[0], set()).discard(sid)
                    prompt, out = a, b
                    self.seqs[sid] = (rid, prompt, out)
                    self.req_seqs.setdefault(rid, set()).add(sid)
                seq_data[sid] = SequenceData(prompt, out, computed)
            groups.append(SequenceGroupMetadata(rid, is_prompt, seq_data, params, tables, chunk,
                                                do_sample))
        return ExecuteModelRequest(groups, enc.blocks_to_swap_in, enc.blocks_to_swap_out,
                                   enc.blocks_to_copy, enc.num_lookahead_slots,
                                   enc.running_queue_size, enc.finished_requests_ids)

