"""The draft-model proposer: a smaller checkpoint with the target's vocabulary, run greedily
in the same worker, with its own paged KV cache over the same block ids.

Under TP/PP the draft runs whole on the output rank (parallel_state.alone()) and its drafts are
broadcast (spec_decode_worker.FromOutputRank). Its cache mirrors the target's block tables, so
the scheduler's bookkeeping, swaps and copy-on-write apply to both; the KV budget is split by
bytes per block. Each step it computes the prompt chunks, catches up on the tokens it has not
cached, then proposes one pass per draft token. Greedy drafts are one-hot: the target accepts
those it drew too (model_runner._accept_drafts), so a stale draft cache only costs acceptance.
"""

from __future__ import annotations

import dataclasses
import math

from fleetllm.config import EngineConfig
from fleetllm.distributed import parallel_state
from fleetllm.errors import OutOfMemoryError
from fleetllm.sampling_params import SamplingParams
from fleetllm.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata
from fleetllm.worker.cache_engine import CacheEngine
from fleetllm.worker.worker import Worker

_GREEDY = SamplingParams(temperature=0.0)


def draft_engine_config(config: EngineConfig) -> EngineConfig:
    """The draft model's config: the target's settings (device, dtype, cache layout, budgets)
    with the draft checkpoint and its own max_model_len (speculative_config's: at most the
    target's), no adapters, no speculation of its own."""
    m, c, s = config.model_config, config.cache_config, config.scheduler_config
    spec = config.speculative_config
    return EngineConfig.from_kwargs(
        spec.model, dtype=m.dtype, max_model_len=spec.max_model_len,
        seed=m.seed, block_size=c.block_size, kv_cache_dtype=c.kv_cache_dtype,
        max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
        device=config.device_config.device, load_format=config.load_config.load_format)


class DraftModelProposer:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.draft_config = draft_engine_config(config)
        # Device and is_output_rank come from the scorer (SpecDecodeWorker.init_device).
        self.worker = Worker(self.draft_config)
        self.computed: dict[int, int] = {}  # seq id -> positions the draft's cache holds
        self.seqs_of: dict[str, set[int]] = {}  # request id -> its seq ids in `computed`
        self.base_len: dict[int, int] = {}  # this step: each drafted sequence's length

    def share_blocks(self, scorer: Worker, num_gpu: int, num_cpu: int) -> tuple[int, int]:
        """The scorer measured its budget in its own blocks; both caches share it."""
        if self.config.cache_config.num_gpu_blocks_override is not None:
            return num_gpu, num_cpu
        target = CacheEngine.block_bytes(self.config, *scorer._kv_shape(), scorer._kv_dtype())
        draft = CacheEngine.block_bytes(self.draft_config, *self.worker._kv_shape(),
                                        self.worker._kv_dtype())
        share = target / (target + draft)
        gpu, cpu = int(num_gpu * share), int(num_cpu * share)
        per_seq = math.ceil(self.config.scheduler_config.max_model_len /
                            self.config.cache_config.block_size)
        if gpu < per_seq:
            raise OutOfMemoryError(
                f"the KV cache budget holds {gpu} blocks for the target and the draft model "
                f"together, fewer than the {per_seq} one sequence of max_model_len needs: "
                "raise kv_cache_memory / gpu_memory_utilization or reduce max_model_len")
        return gpu, cpu

    def forget(self, request_ids: list[str] | None) -> None:
        if request_ids is None:
            self.computed.clear()
            self.seqs_of.clear()
        for rid in request_ids or ():
            for sid in self.seqs_of.pop(rid, ()):
                self.computed.pop(sid, None)

    def _note(self, request_id: str, seq_id: int, computed: int) -> None:
        self.computed[seq_id] = computed
        self.seqs_of.setdefault(request_id, set()).add(seq_id)

    def propose(self, req: ExecuteModelRequest, budgets: dict[int, int]
                ) -> dict[int, list[int]]:
        with parallel_state.alone():  # beside a TP/PP target, the draft runs whole here
            return self._propose(req, budgets)

    def _propose(self, req: ExecuteModelRequest, budgets: dict[int, int]
                 ) -> dict[int, list[int]]:
        runner, cache = self.worker.model_runner, self.worker.cache_engine
        cache.swap_out(req.blocks_to_swap_out)
        cache.swap_in(req.blocks_to_swap_in)
        cache.copy(req.blocks_to_copy)
        groups = req.seq_group_metadata_list
        # Chunks past the draft's max_model_len are not cached: such a sequence is never
        # drafted (SpecDecodeWorker._budgets keeps drafting within the draft's positions).
        limit = self.draft_config.model_config.max_model_len
        prompts = [_greedy(g) for g in groups if g.is_prompt and g.pooling_params is None
                   and all(d.num_computed_tokens + (g.token_chunk_size or d.get_len() -
                                                    d.num_computed_tokens) <= limit
                           for d in g.seq_data.values())]
        if prompts:  # the draft caches the step's prompt chunks too
            runner.execute_model(ExecuteModelRequest(prompts), cache.gpu_cache)
            for g in prompts:
                for sid, data in g.seq_data.items():
                    chunk = g.token_chunk_size or data.get_len() - data.num_computed_tokens
                    self._note(g.request_id, sid, data.num_computed_tokens + chunk)
        # One single-sequence group per drafted sequence (forks may differ in what the draft
        # has cached), on its own copy of the tokens that the proposals extend.
        seqs = [(g, sid, SequenceData(d.prompt_token_ids, list(d.output_token_ids), 0,
                                      d.sample_index))
                for g in groups for sid, d in g.seq_data.items() if sid in budgets]
        drafts: dict[int, list[int]] = {sid: [] for _, sid, _ in seqs}
        self.base_len = {sid: data.get_len() for _, sid, data in seqs}
        for step in range(max(budgets.values(), default=0)):
            active = [(g, sid, data) for g, sid, data in seqs if budgets[sid] > step]
            sub = []
            for g, sid, data in active:
                length = data.get_len()
                if step == 0:  # catch up from what the draft has cached, then draw
                    data.num_computed_tokens = min(self.computed.get(sid, 0), length - 1)
                    chunk = length - data.num_computed_tokens
                else:
                    data.num_computed_tokens, chunk = length - 1, 1
                sub.append(SequenceGroupMetadata(
                    g.request_id, is_prompt=step == 0, seq_data={sid: data},
                    sampling_params=_GREEDY, block_tables={sid: g.block_tables[sid]},
                    token_chunk_size=chunk, do_sample=True))
            [out] = runner.execute_model(ExecuteModelRequest(sub), cache.gpu_cache)
            for (_, sid, data), group_out in zip(active, out.outputs, strict=True):
                token = group_out.samples[0].output_token
                drafts[sid].append(token)
                data.output_token_ids.append(token)
        return drafts

    def step_done(self, req: ExecuteModelRequest, drafts: dict[int, list[int]],
                  emitted: dict[int, int]) -> None:
        """The draft cached its inputs up to the last proposal but one (the last was drawn,
        not fed back); of those, the accepted drafts' positions hold the real tokens."""
        rid_of = {sid: g.request_id for g in req.seq_group_metadata_list for sid in g.seq_data}
        for sid, draft in drafts.items():
            accepted = emitted.get(sid, 1) - 1
            self._note(rid_of[sid], sid, self.base_len[sid] + min(accepted, len(draft) - 1))


def _greedy(group: SequenceGroupMetadata) -> SequenceGroupMetadata:
    """The group as the draft runs it: argmax, no logprobs, penalties, grammar or adapter."""
    return dataclasses.replace(group, sampling_params=_GREEDY, grammar_bitmask=None,
                               lora_request=None)
