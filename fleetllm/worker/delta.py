"""Delta encoding of ExecuteModelRequest between a driver and its worker processes (mp, ray).

How: the driver's DeltaEncoder remembers per seq_id how many tokens the workers hold and sends
only new output tokens (computed counts and block tables in full, SamplingParams and the
LoRARequest once per request); each worker's DeltaDecoder (in WorkerWrapperBase) rebuilds full
SequenceData before Worker.execute_model, and drops finished requests' entries.
What fails: every rank sees the same stream, so a decode failure happens on all ranks before
anything runs (DeltaDesync) and the driver resends the step in full with a cache reset; the
driver also sends full data whenever its bookkeeping does not match the request. It lives in
fleetllm.worker because workers decode it and must not import the executors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetllm.lora.request import LoRARequest
from fleetllm.sampling_params import SamplingParams
from fleetllm.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata

# per-sequence entry kinds inside an EncodedRequest
_FULL, _DELTA = 0, 1


@dataclass
class EncodedRequest:
    """An ExecuteModelRequest with token histories replaced by deltas where possible."""

    # per group: (request_id, is_prompt, seqs, sampling_params or None, block_tables,
    #             token_chunk_size, do_sample, pooling_params, grammar_bitmask,
    #             lora_request);
    #   lora_request travels with sampling_params (None when those are not sent);
    #   seqs: [(seq_id, kind, a, b, num_computed, sample_index)]
    #   kind _FULL: a = prompt ids, b = output ids; _DELTA: a = None, b = new output ids
    groups: list[tuple]
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)
    num_lookahead_slots: int = 0
    running_queue_size: int | None = None
    finished_requests_ids: list[str] = field(default_factory=list)
    reset: bool = False  # workers clear their whole cache before decoding
    num_steps: int = 1
    kv_connector_metadata: Any = None  # passed through as is (fleetllm/kv_transfer)

    def __reduce__(self):  # positional: no field names on the wire
        return (EncodedRequest, (self.groups, self.blocks_to_swap_in, self.blocks_to_swap_out,
                                 self.blocks_to_copy, self.num_lookahead_slots,
                                 self.running_queue_size, self.finished_requests_ids,
                                 self.reset, self.num_steps, self.kv_connector_metadata))


class DeltaDesync(Exception):
    """The worker's cache does not match what the driver assumed: resend full data."""


class DeltaEncoder:
    """Driver side: what the workers hold, per seq id and per request id."""

    def __init__(self) -> None:
        # seq_id -> [request_id, prompt list as sent, prompt_len, output_len, last output token]
        # (the prompt is kept by reference: the engine's list, not a copy)
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
                if (st is not None and st[0] == rid and st[2] == len(prompt)
                        and (st[1] is prompt or st[1] == prompt) and st[3] <= len(out)
                        and (st[3] == 0 or out[st[3] - 1] == st[4])):
                    seqs.append((sid, _DELTA, None, out[st[3]:], data.num_computed_tokens,
                                 data.sample_index))
                else:
                    seqs.append((sid, _FULL, list(prompt), list(out), data.num_computed_tokens,
                                 data.sample_index))
                    if st is not None and st[0] != rid:
                        self.req_seqs.get(st[0], set()).discard(sid)
                    st = self.seqs[sid] = [rid, prompt, len(prompt), 0, None]
                    self.req_seqs.setdefault(rid, set()).add(sid)
                st[1] = prompt
                st[3] = len(out)
                st[4] = out[-1] if out else None
            groups.append((rid, g.is_prompt, seqs, params, g.block_tables, g.token_chunk_size,
                           g.do_sample, g.pooling_params, g.grammar_bitmask,
                           None if params is None else g.lora_request))
        return EncodedRequest(groups, req.blocks_to_swap_in, req.blocks_to_swap_out,
                              req.blocks_to_copy, req.num_lookahead_slots,
                              req.running_queue_size, list(req.finished_requests_ids), reset,
                              req.num_steps, req.kv_connector_metadata)


class DeltaDecoder:
    """Worker side: per-seq SequenceData caches, rebuilt into full requests."""

    def __init__(self) -> None:
        self.seqs: dict[int, tuple[str, list[int], list[int]]] = {}  # id -> (rid, prompt, out)
        self.req_seqs: dict[str, set[int]] = {}
        self.params: dict[str, SamplingParams] = {}
        self.loras: dict[str, LoRARequest] = {}

    def clear(self) -> None:
        self.loras.clear()
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
            self.loras.pop(rid, None)
        # Validate everything before changing anything: a desync leaves the cache untouched
        # on every rank alike, and nothing has run.
        for rid, _, seqs, params, *_ in enc.groups:
            if params is None and rid not in self.params:
                raise DeltaDesync(f"no sampling params cached for request {rid!r}")
            for sid, kind, *_ in seqs:
                if kind == _DELTA and (sid not in self.seqs or self.seqs[sid][0] != rid):
                    raise DeltaDesync(f"sequence {sid} of request {rid!r} is not cached")
        groups = []
        for rid, is_prompt, seqs, params, tables, chunk, do_sample, pooling, bitmask, lora in \
                enc.groups:
            if params is None:
                params, lora = self.params[rid], self.loras.get(rid)
            else:
                self.params[rid] = params
                if lora is None:
                    self.loras.pop(rid, None)
                else:
                    self.loras[rid] = lora
            seq_data = {}
            for sid, kind, a, b, computed, sample_index in seqs:
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
                seq_data[sid] = SequenceData(prompt, out, computed, sample_index)
            groups.append(SequenceGroupMetadata(rid, is_prompt, seq_data, params, tables, chunk,
                                                do_sample, pooling, grammar_bitmask=bitmask,
                                                lora_request=lora))
        return ExecuteModelRequest(groups, enc.blocks_to_swap_in, enc.blocks_to_swap_out,
                                   enc.blocks_to_copy, enc.num_lookahead_slots,
                                   enc.running_queue_size, enc.finished_requests_ids,
                                   enc.num_steps, enc.kv_connector_metadata)

