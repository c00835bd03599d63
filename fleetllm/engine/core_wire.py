"""What the API process and the engine-core process say to each other (core_client <->
core_proc): msgpack messages (msgspec) in mp_transport's length-prefixed frames on AF_UNIX
socket pairs; docs/architecture.md#the-engine-core-process lists every message.

No pickle: a message is lists, maps, strings and numbers, and an error travels as its class
name and message, rebuilt from fleetllm's own error classes only (load_error). A step's
outputs travel as deltas (DeltaEncoder, core side): per request only the text, token ids and
logprobs new since its last delta; the API side rebuilds cumulative outputs from them
(RequestState; PoolingState for a pooling request's one delta). A value msgpack cannot carry
is that request's InvalidRequestError from encode(), never the writer thread's failure.
"""

from __future__ import annotations

import socket
from dataclasses import fields
from typing import Any

import msgspec
import torch

from fleetllm import errors
from fleetllm.engine.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from fleetllm.engine.stats import EngineLoad
from fleetllm.executor import mp_transport as tr
from fleetllm.lora.request import LoRARequest
from fleetllm.pooling_params import PoolingParams
from fleetllm.sampling_params import SamplingParams
from fleetllm.sequence import Logprob, RequestMetrics

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()
_PARAM_FIELDS = [f.name for f in fields(SamplingParams)]
_POOLING_FIELDS = [f.name for f in fields(PoolingParams)]


def send(sock: socket.socket, msg: Any) -> None:
    tr.send_frame(sock, _encoder.encode(msg))


def encode(msg: Any) -> bytes:
    """A message's bytes, encoded by the caller (never by the writer thread, which one bad
    value would kill): a value msgpack cannot carry (an int outside [-2**63, 2**64 - 1], a
    string with a lone surrogate, nesting too deep) is that request's InvalidRequestError."""
    try:
        return _encoder.encode(msg)
    except (OverflowError, UnicodeError, RecursionError, TypeError) as e:
        raise errors.InvalidRequestError(f"the request holds a value that cannot be "
                                         f"sent to the engine: {e}") from None


def send_encoded(sock: socket.socket, body: bytes) -> None:
    tr.send_frame(sock, body)


def recv(sock: socket.socket) -> Any:
    """One message, blocking; None when the peer is gone."""
    try:
        body = tr.recv_frame(sock)
    except OSError:  # reset, or closed under a blocked reader by shutdown()
        return None
    return None if body is None else _decoder.decode(body)


class FrameReader:
    """Non-blocking side: feed() what recv() returned, then take the whole messages."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        return [_decoder.decode(frame) for frame in tr.take_frames(self._buf)]


class FrameBuffer(FrameReader):
    """A FrameReader that keeps the whole messages until take() (the client's control
    socket: a probe's reader stops at its own reply)."""

    def __init__(self) -> None:
        super().__init__()
        self._ready: list[Any] = []

    def feed(self, data: bytes) -> list[Any]:
        self._ready += super().feed(data)
        return []

    def take(self) -> list[Any]:
        ready, self._ready = self._ready, []
        return ready


# ------------------------------------------------------------------ errors


def error_msg(exc: BaseException) -> list[str]:
    message = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
    return [type(exc).__name__, message]


def load_error(msg: list[str]) -> BaseException:
    """fleetllm's own class of that name (its message as raised), else a RuntimeError that
    names the remote type."""
    name, message = msg
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.FleetLLMError):
        try:
            return cls(message)
        except Exception:
            pass
    return RuntimeError(f"{name}: {message}")


# ------------------------------------------------------------------ requests


def prompt_parts(prompt: Any) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of a prompt for an add, either None when absent; anything else is sent
    as no prompt at all, for the core's engine to reject with its message."""
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        return prompt.get("prompt"), None if ids is None else list(ids)
    if isinstance(prompt, list):
        return None, list(prompt)
    return (prompt if isinstance(prompt, str) else None), None


def params_msg(params: SamplingParams | PoolingParams) -> list[Any] | dict[str, Any]:
    if isinstance(params, PoolingParams):
        return {name: getattr(params, name) for name in _POOLING_FIELDS}
    return [getattr(params, name) for name in _PARAM_FIELDS]


def load_params(values: list[Any] | dict[str, Any]) -> SamplingParams | PoolingParams:
    """The params of an add; PoolingParams and SamplingParams validate what they are given
    (ConfigurationError), and a map with other keys is refused (TypeError)."""
    if isinstance(values, dict):
        return PoolingParams(**values)
    return SamplingParams(**dict(zip(_PARAM_FIELDS, values, strict=True)))


def lora_msg(lora_request: LoRARequest | None) -> list[Any] | None:
    if lora_request is None:
        return None
    return [lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path]


def load_lora(msg: list[Any] | None) -> LoRARequest | None:
    """The LoRARequest of an add or an add_lora call: three plain fields, never an object
    (LoRARequest checks them)."""
    if msg is None:
        return None
    name, int_id, path = msg
    return LoRARequest(name, int_id, path)


def load_msg(load: EngineLoad) -> list[Any]:
    return _flat(load)


def _flat(obj: Any) -> list[Any]:
    """A dataclass of plain values as a list, in field order: sent on every step, where
    dataclasses.astuple (a deep copy) took 11 us."""
    return [getattr(obj, f.name) for f in fields(obj)]


# ------------------------------------------------------------------ outputs


def _logprobs_msg(entries: list[dict[int, Logprob]] | None) -> list | None:
    if entries is None:
        return None
    return [[[t, lp.logprob, lp.rank, lp.decoded_token] for t, lp in e.items()]
            for e in entries]


def _load_logprobs(msg: list | None) -> list[dict[int, Logprob]] | None:
    if msg is None:
        return None
    return [{t: Logprob(lp, rank, text) for t, lp, rank, text in e} for e in msg]


class DeltaEncoder:
    """Core side: what each request's outputs added since its last delta."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, tuple[int, int]]] = {}  # id -> index -> (chars, tokens)

    def encode(self, out: RequestOutput | PoolingRequestOutput) -> list[Any]:
        if isinstance(out, PoolingRequestOutput):  # one delta, the whole result
            data = out.outputs.data
            return [out.request_id, out.finished, out.error, _metrics_msg(out),
                    None if data is None else data.detach().to("cpu", torch.float32).tolist()]
        first = out.request_id not in self._sent
        sent = self._sent.setdefault(out.request_id, {})
        seqs = []
        for c in out.outputs:
            chars, tokens = sent.get(c.index, (0, 0))
            sent[c.index] = (len(c.text), len(c.token_ids))
            seqs.append([c.index, c.text[chars:], c.token_ids[tokens:],
                         _logprobs_msg(None if c.logprobs is None else c.logprobs[tokens:]),
                         c.cumulative_logprob, c.finish_reason, c.stop_reason])
        if out.finished:
            del self._sent[out.request_id]
        metrics = _metrics_msg(out)
        prompt_lp = out.prompt_logprobs if first else None
        return [out.request_id, out.finished, out.error, metrics,
                None if prompt_lp is None else [None if e is None else _logprobs_msg([e])[0]
                                                for e in prompt_lp], seqs,
                out.kv_transfer_params]

    def resumed(self, request_id: str, sent: dict[int, tuple[int, int]]) -> None:
        """A resumed request: the API process already has `sent` (index -> (characters,
        tokens)) of each sequence, and its prompt logprobs."""
        self._sent[request_id] = dict(sent)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


def _metrics_msg(out: RequestOutput | PoolingRequestOutput) -> list[float] | None:
    if not out.finished or out.metrics is None:
        return None
    return _flat(out.metrics)


class RequestState:
    """API side: one request's outputs so far, rebuilt from its deltas."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs: list | None = None
        self.seqs: dict[int, CompletionOutput] = {}
        self.add: list[Any] = []  # its add message's fields after "add" (a new core's)

    def resume_msg(self) -> list[Any]:
        """For a new core: the add again, and once tokens were streamed, a "resume" that
        goes on from them."""
        if not any(s.token_ids for s in self.seqs.values()):
            return ["add", *self.add]
        return ["resume", *self.add,
                [[s.index, s.token_ids, s.text, s.cumulative_logprob or 0.0, s.finish_reason,
                  s.stop_reason] for _, s in sorted(self.seqs.items())]]

    def apply(self, delta: list[Any]) -> RequestOutput:
        _, finished, error, metrics, prompt_lp, seqs, kv_params = delta
        if prompt_lp is not None:
            self.prompt_logprobs = [None if e is None else _load_logprobs([e])[0]
                                    for e in prompt_lp]
        for index, text, ids, lps, cum, finish, stop in seqs:
            seq = self.seqs.get(index)
            if seq is None:
                seq = self.seqs[index] = CompletionOutput(
                    index, "", [], None, None if lps is None else [])
            seq.text += text
            seq.token_ids.extend(ids)
            if lps is not None:
                seq.logprobs.extend(_load_logprobs(lps))
            seq.cumulative_logprob, seq.finish_reason, seq.stop_reason = cum, finish, stop
        # Copies, as LLMEngine's outputs are: a consumer may keep an earlier output.
        outputs = [CompletionOutput(s.index, s.text, list(s.token_ids), s.cumulative_logprob,
                                    None if s.logprobs is None else list(s.logprobs),
                                    s.finish_reason, s.stop_reason)
                   for _, s in sorted(self.seqs.items())]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             self.prompt_logprobs, outputs, finished,
                             None if metrics is None else RequestMetrics(*metrics), error,
                             kv_params)


class PoolingState:
    """API side: a pooling request, rebuilt from its one delta as a PoolingRequestOutput whose
    `outputs.data` is a float32 tensor (exactly the core's values: msgpack sends each float32
    as a float64)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.add: list[Any] = []

    def resume_msg(self) -> list[Any]:
        return ["add", *self.add]

    def apply(self, delta: list[Any]) -> PoolingRequestOutput:
        _, finished, error, metrics, vector = delta
        data = None if vector is None else torch.tensor(vector, dtype=torch.float32)
        return PoolingRequestOutput(
            self.request_id, PoolingOutput(data), list(self.prompt_token_ids), finished, error,
            None if metrics is None else RequestMetrics(*metrics), self.prompt)
