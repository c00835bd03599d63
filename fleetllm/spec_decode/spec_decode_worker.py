"""SpecDecodeWorker: speculative decoding around a scoring worker, behind the worker API.

With a speculative_config WorkerWrapperBase wraps the configured worker (the scorer) with
create_spec_worker. Each step a proposer drafts up to num_speculative_tokens per decoding
sequence (n-gram lookup: ngram_proposer.py, or a greedy draft model: draft_model.py); the
scorer runs the target once over each sequence's last token and drafts, draws a token at every
position and keeps the drafts it drew too (model_runner._accept_drafts: rejection sampling for
one-hot drafts, so greedy and seeded outputs equal those without speculation). It returns one
SamplerOutput per emitted position, the first carrying SpecDecodeWorkerMetrics. Which
sequences are drafted: fast_paths.may_draft. What fails: a step fails as a whole, as any
step; the proposers' state only changes which drafts are proposed, never the output.
"""

from __future__ import annotations

from typing import Protocol

import torch

from fleetllm import fast_paths
from fleetllm.config import EngineConfig
from fleetllm.distributed import parallel_state
from fleetllm.sequence import ExecuteModelRequest, SamplerOutput
from fleetllm.spec_decode.metrics import SpecDecodeWorkerMetrics
from fleetllm.spec_decode.ngram_proposer import NgramIndex, NgramProposer
from fleetllm.worker.worker_base import DelegatingWorker, WorkerBase


class Proposer(Protocol):
    def propose(self, req: ExecuteModelRequest, budgets: dict[int, int]
                ) -> dict[int, list[int]]:
        """Drafts of at most budgets[seq_id] tokens for the sequences named there."""

    def step_done(self, req: ExecuteModelRequest, drafts: dict[int, list[int]],
                  emitted: dict[int, int]) -> None:
        """The step ran: `emitted[seq_id]` tokens were emitted for each drafted sequence."""

    def forget(self, request_ids: list[str] | None) -> None:
        """Drop the state of these requests (None: of all)."""


def create_spec_worker(scorer: WorkerBase, config: EngineConfig) -> SpecDecodeWorker:
    return SpecDecodeWorker(scorer, config)


class SpecDecodeWorker(DelegatingWorker):
    """self.worker is the scorer: the configured worker, running the target model."""

    def __init__(self, scorer: WorkerBase, config: EngineConfig) -> None:
        super().__init__(scorer)
        spec = config.speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens
        self.max_model_len = config.model_config.max_model_len
        # The longest sequence a draft model drafts (its own max_model_len, at most the
        # target's: speculative_config.max_model_len); past it a sequence decodes without.
        self.draft_max_len = spec.max_model_len or self.max_model_len
        self.block_size = config.cache_config.block_size
        self.draft_proposer = None  # method "draft_model", on the output rank only
        # Back-off: a sequence whose drafts keep being rejected stops paying for them.
        self.misses: dict[int, int] = {}  # seq id -> drafted steps in a row with none kept
        self.cooldown: dict[int, int] = {}  # seq id -> steps left without drafts
        self.seqs_of: dict[str, set[int]] = {}  # request id -> its seq ids in those
        self.drafted: dict[int, int] = {}  # seq id -> its length when last drafted
        if spec.method == "draft_model":
            from fleetllm.spec_decode.draft_model import DraftModelProposer

            pc = config.parallel_config
            draft = None  # the draft runs whole on the output rank (parallel_state.alone)
            if getattr(scorer, "rank", 0) == parallel_state.output_rank(
                    pc.tensor_parallel_size, pc.pipeline_parallel_size):
                self.draft_proposer = draft = DraftModelProposer(config)
            self.proposer: Proposer = draft if pc.world_size == 1 else \
                FromOutputRank(draft, scorer)
        else:
            self.proposer = NgramLookup(NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max))

    @property
    def draft(self) -> WorkerBase | None:
        """The draft model's Worker, beside the scorer (None: no draft model on this rank)."""
        return None if self.draft_proposer is None else self.draft_proposer.worker

    # The scorer's worker API, and the draft model's, which lives beside it.
    def init_device(self) -> None:
        self.worker.init_device()
        if self.draft is not None:
            self.draft.device, self.draft.is_output_rank = self.worker.device, True

    def load_model(self) -> None:
        self.worker.load_model()
        if self.draft is not None:
            with parallel_state.alone():
                self.draft.load_model()

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """With a draft model, the output rank's budget holds both caches (every rank then
        takes the smallest count: the executor's min over ranks)."""
        num_gpu, num_cpu = self.worker.determine_num_available_blocks()
        if self.draft_proposer is None:
            return num_gpu, num_cpu
        with parallel_state.alone():
            return self.draft_proposer.share_blocks(self.worker, num_gpu, num_cpu)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        if self.draft is not None:  # the same block ids: the draft's K/V of the same tokens
            with parallel_state.alone():
                self.draft.initialize_cache(num_gpu_blocks, num_cpu_blocks)

    # The draft sleeps and wakes as it was loaded, whole (alone()): woken under a TP/PP
    # target's groups it would reload as a shard and fail its rank at the next step.
    def sleep(self, level: int = 1) -> int:
        freed = self.worker.sleep(level)
        if self.draft is not None:
            with parallel_state.alone():
                freed += self.draft.sleep(level)
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.worker.wake_up(tags)
        if self.draft is not None:
            with parallel_state.alone():
                self.draft.wake_up(tags)

    def shutdown(self) -> None:
        self.proposer.forget(None)
        if self.draft is not None:
            self.draft.shutdown()
        self.worker.shutdown()

    def execute_model(self, execute_model_req: ExecuteModelRequest
                      ) -> list[SamplerOutput] | None:
        req = execute_model_req
        self.proposer.forget(req.finished_requests_ids)
        for rid in req.finished_requests_ids:
            for sid in self.seqs_of.pop(rid, ()):
                for state in (self.misses, self.cooldown, self.drafted):
                    state.pop(sid, None)
        self._back_off(req)
        budgets = self._budgets(req) if req.num_lookahead_slots else {}
        drafts = {sid: d for sid, d in self.proposer.propose(req, budgets).items() if d}
        outputs = self.worker.execute_model(req, drafts) if drafts else \
            self.worker.execute_model(req)
        if outputs and len(outputs) > 1:
            _advance_groups_together(outputs)
        emitted: dict[int, int] = {}
        for out in outputs or ():
            for group in out.outputs:
                for s in getattr(group, "samples", ()):
                    if s.parent_seq_id in drafts:
                        emitted[s.parent_seq_id] = emitted.get(s.parent_seq_id, 0) + 1
        self.proposer.step_done(req, drafts, emitted)
        for group in req.seq_group_metadata_list:
            for sid, data in group.seq_data.items():
                if sid in drafts:
                    self.drafted[sid] = data.get_len()
                    self.seqs_of.setdefault(group.request_id, set()).add(sid)
        if outputs and drafts:
            outputs[0].spec_decode_worker_metrics = self._metrics(drafts, emitted)
        return outputs

    def _budgets(self, req: ExecuteModelRequest) -> dict[int, int]:
        """Per decoding sequence that may be drafted: the most draft tokens it can use (the
        room after this step's own token under max_tokens and max_model_len, and the slots
        its block table holds past it: the scheduler may have had no room for lookahead)."""
        most = min(self.num_spec_tokens, req.num_lookahead_slots)
        budgets = {}
        for group in req.seq_group_metadata_list:
            if not fast_paths.may_draft(group):
                continue
            max_tokens = group.sampling_params.max_tokens
            for seq_id, data in group.seq_data.items():
                if self.cooldown.get(seq_id, 0) > 0:
                    self.cooldown[seq_id] -= 1
                    continue
                room = min(self.max_model_len - data.get_len() - 1,
                           len(group.block_tables[seq_id]) * self.block_size - data.get_len(),
                           self.draft_max_len - data.get_len())  # positions the draft has
                if max_tokens is not None:
                    room = min(room, max_tokens - len(data.output_token_ids) - 1)
                # After a step whose drafts were all rejected, a sequence is probed with one
                # draft token (a pass of the draft model, one more row to score) until one is
                # kept again: a useless proposer's failures then cost a probe each.
                budget = min(room, most, 1 if self.misses.get(seq_id) else most)
                if budget > 0:
                    budgets[seq_id] = budget
        return budgets

    def _back_off(self, req: ExecuteModelRequest) -> None:
        """A sequence whose drafts were all rejected twice in a row goes without drafts for
        1, 2, 4, ... 64 steps (doubling while they keep failing), and is probed with one
        draft token in between (_budgets): a useless proposer (a draft model that disagrees,
        text that never repeats) then costs a few percent, not a drafted step's price every
        step. Any accepted draft resets it. What was accepted is read off this step's
        request (a drafted sequence that grew by one token had none kept), so every rank
        decides alike: only the output rank sees the samples."""
        for group in req.seq_group_metadata_list:
            for sid, data in group.seq_data.items():
                base = self.drafted.pop(sid, None)
                if base is None or group.is_prompt:
                    continue
                if data.get_len() - base > 1:
                    self.misses[sid] = 0
                    continue
                misses = self.misses[sid] = self.misses.get(sid, 0) + 1
                if misses >= 2:
                    self.cooldown[sid] = min(2 ** (misses - 2), 64)

    def _metrics(self, drafts: dict[int, list[int]], emitted: dict[int, int]
                 ) -> SpecDecodeWorkerMetrics:
        m = SpecDecodeWorkerMetrics(self.num_spec_tokens,
                                    draft_tokens=sum(map(len, drafts.values())),
                                    spec_sequences=len(drafts),
                                    emitted_tokens=sum(emitted.values()))
        m.accepted_tokens = m.emitted_tokens - m.spec_sequences
        return m


def _advance_groups_together(outputs: list[SamplerOutput]) -> None:
    """The n samples of a request advance together (the scheduler sizes a group's chunks,
    e.g. when it is recomputed, by one length for all): a sample whose drafts were accepted
    further than a sibling's keeps only as many tokens as the sibling emitted. The dropped
    ones were exact draws too; the next step draws them again (the same, when seeded)."""
    for index in range(len(outputs[0].outputs)):
        per_seq: dict[int, int] = {}
        for out in outputs:
            for s in out.outputs[index].samples:
                per_seq[s.parent_seq_id] = per_seq.get(s.parent_seq_id, 0) + 1
        if len(per_seq) < 2:
            continue
        keep = min(per_seq.values())
        for out in outputs[keep:]:
            out.outputs[index].samples.clear()


class FromOutputRank:
    """A draft model beside a tensor- or pipeline-parallel target: the output rank runs it
    (proposer) and broadcasts its drafts to every rank, which all score them. Every rank
    computes the same budgets from the same request, so the grid's shape agrees."""

    def __init__(self, proposer: Proposer | None, scorer: WorkerBase) -> None:
        self.proposer, self.scorer = proposer, scorer

    def propose(self, req: ExecuteModelRequest, budgets: dict[int, int]
                ) -> dict[int, list[int]]:
        if not budgets:
            return {}
        seq_ids = sorted(budgets)
        grid = torch.full((len(seq_ids), max(budgets.values())), -1, dtype=torch.long)
        if self.proposer is not None:
            drafts = self.proposer.propose(req, budgets)
            for row, sid in enumerate(seq_ids):
                grid[row, :len(drafts.get(sid, ()))] = torch.tensor(drafts.get(sid, []))
        grid = parallel_state.broadcast_from_output_rank(grid.to(self.scorer.device)).tolist()
        return {sid: [t for t in row if t >= 0] for sid, row in zip(seq_ids, grid, strict=True)}

    def step_done(self, req: ExecuteModelRequest, drafts: dict[int, list[int]],
                  emitted: dict[int, int]) -> None:
        if self.proposer is not None:
            self.proposer.step_done(req, drafts, emitted)

    def forget(self, request_ids: list[str] | None) -> None:
        if self.proposer is not None:
            self.proposer.forget(request_ids)


class NgramLookup:
    """The n-gram proposer over each sequence's tokens, with an incremental index per
    sequence."""

    def __init__(self, proposer: NgramProposer) -> None:
        self.proposer = proposer
        self.indexes: dict[str, dict[int, NgramIndex]] = {}  # request id -> seq id -> index

    def propose(self, req: ExecuteModelRequest, budgets: dict[int, int]
                ) -> dict[int, list[int]]:
        drafts = {}
        for group in req.seq_group_metadata_list:
            indexes = self.indexes.setdefault(group.request_id, {})
            for seq_id, data in group.seq_data.items():
                if seq_id not in budgets:
                    continue
                index = indexes.get(seq_id)
                if index is None:
                    index = indexes[seq_id] = NgramIndex(self.proposer)
                drafts[seq_id] = index.propose(data.all_token_ids)[:budgets[seq_id]]
        return drafts

    def step_done(self, req: ExecuteModelRequest, drafts: dict[int, list[int]],
                  emitted: dict[int, int]) -> None:
        pass

    def forget(self, request_ids: list[str] | None) -> None:
        if request_ids is None:
            self.indexes.clear()
        for rid in request_ids or ():
            self.indexes.pop(rid, None)
