"""SpecDecodeWorker: speculative decoding around a scoring worker, behind the worker API.

The configuration picks the worker (WorkerWrapperBase): with a speculative_config, the
configured worker (the scorer, which runs the target model) is wrapped by create_spec_worker.
Per step, for each decoding sequence the proposer drafts up to num_speculative_tokens tokens
(n-gram prompt lookup: no second model, the same drafts on every rank); the scorer runs the
target model once over each sequence's last token and its drafts (the KV slots for them are
the scheduler's lookahead slots), draws a token at every position, and keeps the drafts the
target drew too, then its own token (see model_runner._accept_drafts: rejection sampling for
a one-hot draft, so outputs are distributed exactly as without speculation; greedy and seeded
requests emit the very same tokens). The step returns one SamplerOutput per emitted position;
the engine appends them in order. The first carries SpecDecodeWorkerMetrics.

Not drafted: prompt steps, requests with a structured-output grammar (their allowed tokens
depend on the drafts), a sequence's last allowed token (max_tokens, max_model_len). A failure
is the scorer's failure: nothing here holds state a restart would lose but the n-gram indexes,
which are rebuilt from the tokens.
"""

from __future__ import annotations

from typing import Any

from fleetllm.config import EngineConfig
from fleetllm.sequence import ExecuteModelRequest, SamplerOutput
from fleetllm.spec_decode.metrics import SpecDecodeWorkerMetrics
from fleetllm.spec_decode.ngram_proposer import NgramIndex, NgramProposer
from fleetllm.worker.worker_base import WorkerBase


def create_spec_worker(scorer: WorkerBase, config: EngineConfig) -> SpecDecodeWorker:
    return SpecDecodeWorker(scorer, config)


class SpecDecodeWorker(WorkerBase):
    def __init__(self, scorer: WorkerBase, config: EngineConfig) -> None:
        spec = config.speculative_config
        self.scorer = scorer
        self.max_model_len = config.model_config.max_model_len
        self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                      spec.prompt_lookup_max)
        self.indexes: dict[str, dict[int, NgramIndex]] = {}  # request id -> seq id -> index

    # The worker API: the scorer's, with execute_model speculating.
    def init_device(self) -> None:
        self.scorer.init_device()

    def load_model(self) -> None:
        self.scorer.load_model()

    def determine_num_available_blocks(self) -> tuple[int, int]:
        return self.scorer.determine_num_available_blocks()

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.scorer.initialize_cache(num_gpu_blocks, num_cpu_blocks)

    def check_health(self) -> None:
        self.scorer.check_health()

    def shutdown(self) -> None:
        self.indexes.clear()
        self.scorer.shutdown()

    def __getattr__(self, name: str) -> Any:  # sleep, wake_up, LoRA calls, model_runner, ...
        if name == "scorer":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.scorer, name)

    def execute_model(self, execute_model_req: ExecuteModelRequest
                      ) -> list[SamplerOutput] | None:
        req = execute_model_req
        for rid in req.finished_requests_ids:
            self.indexes.pop(rid, None)
        drafts = self._propose(req) if req.num_lookahead_slots else {}
        outputs = self.scorer.execute_model(req, drafts) if drafts else \
            self.scorer.execute_model(req)
        if outputs and drafts:
            outputs[0].spec_decode_worker_metrics = self._metrics(drafts, outputs)
        return outputs

    def _propose(self, req: ExecuteModelRequest) -> dict[int, list[int]]:
        most = min(self.proposer.num_speculative_tokens, req.num_lookahead_slots)
        drafts = {}
        for group in req.seq_group_metadata_list:
            if group.is_prompt or not group.do_sample or group.grammar_bitmask is not None:
                continue
            params = group.sampling_params
            indexes = self.indexes.setdefault(group.request_id, {})
            for seq_id, data in group.seq_data.items():
                # Room after this step's own token: max_tokens and max_model_len bound it.
                room = self.max_model_len - data.get_len() - 1
                if params.max_tokens is not None:
                    room = min(room, params.max_tokens - len(data.output_token_ids) - 1)
                if min(room, most) <= 0:
                    continue
                index = indexes.get(seq_id)
                if index is None:
                    index = indexes[seq_id] = NgramIndex(self.proposer)
                draft = index.propose(data.all_token_ids)[:min(room, most)]
                if draft:
                    drafts[seq_id] = draft
        return drafts

    def _metrics(self, drafts: dict[int, list[int]], outputs: list[SamplerOutput]
                 ) -> SpecDecodeWorkerMetrics:
        m = SpecDecodeWorkerMetrics(self.proposer.num_speculative_tokens,
                                    draft_tokens=sum(map(len, drafts.values())),
                                    spec_sequences=len(drafts))
        for out in outputs:
            for group in out.outputs:
                m.emitted_tokens += sum(1 for s in group.samples if s.parent_seq_id in drafts)
        m.accepted_tokens = m.emitted_tokens - m.spec_sequences
        return m
