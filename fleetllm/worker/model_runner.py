"""ModelRunner: ExecuteModelRequest -> flat token batch -> forward -> logits -> sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fleetllm.attention import AttentionMetadata, DecodeBatch, PrefillSpan
from fleetllm.config import EngineConfig
from fleetllm.distributed.parallel_state import get_pp_group
from fleetllm.lora import layers as lora_layers
from fleetllm.lora.manager import LoRAManager, lora_torch_dtype
from fleetllm.model.loader import build_model
from fleetllm.model.moe_load import clear_expert_load
from fleetllm.sequence import (
    CompletionSequenceGroupOutput,
    ExecuteModelRequest,
    Logprob,
    SamplerOutput,
    SequenceData,
    SequenceGroupMetadata,
    SequenceOutput,
)
from fleetllm.worker import sampler
from fleetllm.worker.cpu_setup import (  # noqa: F401 - available_cores: its old import path
    available_cores,
    keep_freed_memory,
    return_freed_memory,
    set_intra_op_threads,
)
from fleetllm.worker.sampler import SampleRow

_set_intra_op_threads = set_intra_op_threads  # its old name (tests/engine/test_perf_guards.py)


@dataclass
class _Batch:
    input_ids: torch.Tensor | list[int]
    positions: torch.Tensor | list[int]
    meta: AttentionMetadata | None
    logits_token_idx: list[int] = field(default_factory=list)  # flat-batch rows needing logits
    sample_rows: list[SampleRow] = field(default_factory=list)
    sample_owner: list[tuple[int, int]] = field(default_factory=list)  # (group, parent seq id)
    # group index -> (first logits row, targets) for prompt logprobs, and whether None leads
    prompt_lp: dict[int, tuple[int, list[int], bool]] = field(default_factory=dict)
    pool_spans: list[tuple[int, int, int]] = field(default_factory=list)  # (group, start, len)
    # speculative decoding: first sample row of a decode with drafts -> its draft tokens
    draft_runs: dict[int, list[int]] = field(default_factory=dict)
    lora: lora_layers.LoRAStep | None = None  # the step's adapter rows, if any


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, is_output_rank: bool):
        self.config = config
        self.device = device
        self.block_size = config.cache_config.block_size
        self.is_output_rank = is_output_rank
        self.model = None
        self.penalties = sampler.PenaltyState()  # per-sequence counts, kept across steps
        self.lora_manager: LoRAManager | None = None  # with enable_lora (fleetllm/lora/)

    def load_model(self) -> None:
        if self.device.type == "cpu":
            keep_freed_memory()
            set_intra_op_threads(self.config.parallel_config.world_size)
        self.model = build_model(self.config, self.device)
        if self.device.type == "cpu":
            return_freed_memory()  # the dense weights the packed copies replaced
        self.dtype = next(self.model.parameters()).dtype
        lora = self.config.lora_config
        if lora is not None:  # the loaded adapters survive a reload (sleep level 2)
            if self.lora_manager is None:
                self.lora_manager = LoRAManager(lora, self.device,
                                                lora_torch_dtype(lora, self.dtype))
            self.lora_manager.attach(self.model)

    def execute_model(self, request: ExecuteModelRequest, kv_caches: list[torch.Tensor] | None,
                      drafts: dict[int, list[int]] | None = None) -> list[SamplerOutput] | None:
        """One step; None on a rank that does not sample. drafts (speculative decoding):
        seq id -> draft tokens to score after a decoding sequence's last token; the result
        then has one SamplerOutput per emitted position (see _accept_drafts)."""
        self.drop_requests(request.finished_requests_ids)
        if not request.seq_group_metadata_list:
            return [SamplerOutput([])] if self.is_output_rank else None
        # Inference mode by its C++ guard: torch.inference_mode()'s Python wrapper runs from
        # memory after a step's weight stream, a measurable part of a batch-1 step.
        with torch._C._InferenceMode(True):
            batch = self._prepare(request, drafts)
            logits = self._forward(batch, kv_caches)
            if logits is None or not self.is_output_rank:
                return None
            return self._sample(request, batch, logits)

    def drop_requests(self, request_ids: list[str]) -> None:
        """Forget what the runner keeps across steps (penalty counts) of ended requests."""
        self.penalties.drop(request_ids)

    def forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata, kv_caches: list[torch.Tensor] | None,
                       logits_rows: list[int]) -> torch.Tensor | None:
        """The forward of a token batch the caller built (the greedy passes build all their
        passes' inputs at once; call it in inference mode): the logits of the flat-batch rows
        logits_rows; None on a stage that is not the last."""
        return self._forward(_Batch(input_ids, positions, meta, logits_rows), kv_caches)

    def _forward(self, batch: _Batch, kv_caches: list[torch.Tensor] | None
                 ) -> torch.Tensor | None:
        """Logits for the batch's logits rows; None on a stage that is not the last."""
        lora_layers.set_step(batch.lora)
        try:
            hidden = self._run_model(batch, kv_caches)
        finally:
            lora_layers.set_step(None)
        if hidden is None:
            return None
        # Possibly no rows (a step of non-final prompt chunks): empty logits, empty samples.
        # Every row (a decode step): no copy. A copy that large is an OpenMP region, whose
        # threads then spin beside the kernels' pool and slow the LM head's GEMM.
        if batch.logits_token_idx == list(range(hidden.shape[0])):
            return self.model.compute_logits(hidden)
        rows = torch.tensor(batch.logits_token_idx, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))

    def _run_model(self, batch: _Batch, kv_caches: list[torch.Tensor] | None
                   ) -> torch.Tensor | None:
        """The forward: every token's final hidden state on the last pipeline stage; an
        earlier stage sends its activations on and returns None."""
        pp = get_pp_group()
        intermediate = None
        if not pp.is_first:
            shape = (batch.input_ids.shape[0], self.config.model_config.arch.hidden_size)
            intermediate = tuple(pp.recv([shape, shape], self.dtype, self.device,
                                         pp.rank_in_group - 1))
        hidden, residual = self.model(batch.input_ids, batch.positions, kv_caches, batch.meta,
                                      intermediate)
        if not pp.is_last:
            pp.send([hidden, residual], pp.rank_in_group + 1)
            return None
        return hidden

    def _prepare(self, request: ExecuteModelRequest,
                 drafts: dict[int, list[int]] | None = None) -> _Batch:
        """The flat token batch: decode tokens (one per sequence) first, then prefill spans.
        Per sequence the Python work is O(1) for a decode (its block table is copied at C
        speed) and O(chunk) for a prefill: nothing walks a sequence's history. A decode with
        m draft tokens is m + 1 decode rows: its last token and each draft at the next
        positions, each attending to the context up to itself (the step writes every new
        token's K/V before any row attends, so the drafts' rows see the drafts before them);
        the decode kernel and the fused layer read the context in place."""
        bs, drafts = self.block_size, drafts or {}
        group_slots = None if self.lora_manager is None else self.lora_manager.prepare(
            [g.lora_request for g in request.seq_group_metadata_list])
        # (group, seq id, data, table, end: the row's position + 1, draft or None)
        dec: list[tuple[int, int, SequenceData, list[int], int, list[int] | None]] = []
        pre: list[tuple[int, int, SequenceData, list[int], int, int]] = []
        for g_index, group in enumerate(request.seq_group_metadata_list):
            for seq_id, data in group.seq_data.items():
                seq_len = data.get_len()
                table = group.block_tables[seq_id]
                if group.is_prompt:  # (a chunk of) the prompt, from the cached prefix on
                    start = data.num_computed_tokens
                    end = min(seq_len, start + (group.token_chunk_size or seq_len - start))
                else:  # decode: the one token whose K/V is not cached yet
                    start, end = seq_len - 1, seq_len
                # A prompt's first token goes the prefill way even alone: a pooling model has
                # no KV cache for the decode kernel to read.
                if end - start == 1 and start > 0:
                    dec.append((g_index, seq_id, data, table, end,
                                None if group.is_prompt else drafts.get(seq_id)))
                else:
                    pre.append((g_index, seq_id, data, table, start, end))
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[int] = []
        table_start: list[int] = []
        ctx_lens: list[int] = []
        batch = _Batch(ids, positions, None)  # tensors replace the lists below
        groups = request.seq_group_metadata_list
        token_groups: list[int] = []  # each decode row's group (LoRA slots)
        for g_index, seq_id, data, table, end, draft in dec:
            first = len(ids)
            for j, token in enumerate([data.token_at(end - 1), *(draft or ())]):
                p = end - 1 + j
                ids.append(token)
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
                table_start.append(len(tables))
                tables += table[: (p + bs) // bs]
                ctx_lens.append(p + 1)
                token_groups.append(g_index)
            if draft:
                self._add_draft_rows(batch, g_index, groups[g_index], seq_id, data, first,
                                     draft)
            else:
                self._add_rows(batch, g_index, groups[g_index], seq_id, data, first, end - 1,
                               end)
        spans: list[PrefillSpan] = []
        for g_index, seq_id, data, table, start, end in pre:
            q_start = len(ids)
            n_prompt = len(data.prompt_token_ids)
            ids += (data.prompt_token_ids[start:end] if end <= n_prompt
                    else data.all_token_ids[start:end])
            positions += range(start, end)
            new_slots = _slots(table, start, end, bs)
            slots += new_slots
            ctx = None if start == 0 else torch.tensor(_slots(table, 0, start, bs) + new_slots,
                                                       device=self.device)
            spans.append(PrefillSpan(q_start, end - start, end, ctx))
            self._add_rows(batch, g_index, groups[g_index], seq_id, data, q_start, start, end)
        dev = self.device
        if group_slots is not None:  # each token's adapter slot, in flat-batch order
            token_slots = [group_slots[g] for g in token_groups]
            for g_index, _, _, _, start, end in pre:
                token_slots += [group_slots[g_index]] * (end - start)
            if max(token_slots) >= 0:
                batch.lora = lora_layers.LoRAStep.build(token_slots, self.lora_manager.dtype,
                                                        dev)
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=dev), spans)
        if dec:
            i32 = torch.int32
            meta.decode = DecodeBatch(torch.tensor(tables, dtype=i32, device=dev),
                                      torch.tensor(table_start, dtype=i32, device=dev),
                                      torch.tensor(ctx_lens, dtype=i32, device=dev))
        batch.input_ids = torch.tensor(ids, device=dev)
        batch.positions = torch.tensor(positions, device=dev)
        batch.meta = meta
        return batch

    @staticmethod
    def _add_rows(batch: _Batch, g_index: int, group: SequenceGroupMetadata, seq_id: int,
                  data: SequenceData, q_start: int, start: int, end: int) -> None:
        """Logits rows for a sequence's span [start, end) at q_start in the flat batch: its
        prompt logprobs, and its draws when the span ends the sequence."""
        params = group.sampling_params
        logits_idx = batch.logits_token_idx
        if group.is_prompt and params.prompt_logprobs is not None:
            last = min(end, len(data.prompt_token_ids) - 1)  # position p predicts token p+1
            targets = data.prompt_token_ids[start + 1: last + 1]
            batch.prompt_lp[g_index] = (len(logits_idx), targets, start == 0)
            logits_idx.extend(range(q_start, q_start + len(targets)))
        if group.do_sample:
            # A fresh prompt's sampled step draws all n samples (indices 0..n-1); after that
            # each sequence draws its own (a recompute too).
            fresh = group.is_prompt and len(group.seq_data) == 1 and not data.output_token_ids
            seq_len = data.get_len()
            allowed = None if group.grammar_bitmask is None else \
                group.grammar_bitmask[list(group.seq_data).index(seq_id)]
            for index in (range(params.n) if fresh else (data.sample_index,)):
                seed = None if params.seed is None else \
                    sampler.draw_seed(params.seed, index, seq_len)
                batch.sample_rows.append(SampleRow(len(logits_idx), params,
                                                   data.prompt_token_ids,
                                                   data.output_token_ids, seed, seq_id,
                                                   allowed))
                batch.sample_owner.append((g_index, seq_id))
            logits_idx.append(q_start + end - start - 1)

    @staticmethod
    def _add_draft_rows(batch: _Batch, g_index: int, group: SequenceGroupMetadata, seq_id: int,
                        data: SequenceData, q_start: int, draft: list[int]) -> None:
        """A draw at each of the len(draft) + 1 positions of a decode with drafts, each as
        the sequence would draw there had the drafts before it been its tokens (penalties,
        min_tokens and the seed of that position see them)."""
        params, seq_len = group.sampling_params, data.get_len()
        batch.draft_runs[len(batch.sample_rows)] = draft
        for j in range(len(draft) + 1):
            seed = None if params.seed is None else \
                sampler.draw_seed(params.seed, data.sample_index, seq_len + j)
            # Rows past the first count penalties from their history (seq_id None): the
            # incremental state follows the sequence's real tokens only.
            batch.sample_rows.append(SampleRow(
                len(batch.logits_token_idx), params, data.prompt_token_ids,
                data.output_token_ids + draft[:j], seed, seq_id if j == 0 else None))
            batch.sample_owner.append((g_index, seq_id))
            batch.logits_token_idx.append(q_start + j)

    def _sample(self, request: ExecuteModelRequest, batch: _Batch, logits: torch.Tensor
                ) -> list[SamplerOutput]:
        groups = request.seq_group_metadata_list
        result = sampler.sample(logits, batch.sample_rows, self.penalties,
                                [groups[g].request_id for g, _ in batch.sample_owner])
        outputs = [CompletionSequenceGroupOutput(g.request_id, []) for g in groups]
        later: list[list[CompletionSequenceGroupOutput]] = []  # positions 2, 3, ... (drafts)
        row = 0
        while row < len(batch.sample_rows):
            g_index, seq_id = batch.sample_owner[row]
            draft = batch.draft_runs.get(row)
            if draft is None:
                outputs[g_index].samples.append(SequenceOutput(
                    seq_id, result.token_ids[row], result.logprobs[row]))
                row += 1
                continue
            emitted = _accept_drafts(draft, result.token_ids[row: row + len(draft) + 1])
            for j, token in enumerate(emitted):
                if j == 0:
                    out = outputs[g_index]
                else:
                    if len(later) < j:
                        later.append([CompletionSequenceGroupOutput(g.request_id, [])
                                      for g in groups])
                    out = later[j - 1][g_index]
                out.samples.append(SequenceOutput(seq_id, token, result.logprobs[row + j]))
            row += len(draft) + 1
        for g_index, (first, targets, leading_none) in batch.prompt_lp.items():
            n = groups[g_index].sampling_params.prompt_logprobs
            chunk: list[dict[int, Logprob] | None] = [None] if leading_none else []
            if targets:
                chunk += sampler.prompt_logprobs(logits[first: first + len(targets)], targets, n)
            outputs[g_index].prompt_logprobs = chunk
        # sampled_token_ids stays None, as in vLLM without a tensor consumer: nothing reads it,
        # and building it costs a batch-1 step measurably from a cold cache.
        return [SamplerOutput(outs) for outs in (outputs, *later)]

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward of the largest batch the scheduler may send, without a KV cache: the
        full token budget in as few max_model_len sequences as fit (the activation peak grows
        with tokens and the longest attention, not with the number of sequences), then
        logits for max_num_seqs rows."""
        sc = self.config.scheduler_config
        total = sc.max_num_batched_tokens
        ids, positions, spans = [], [], []
        while len(ids) < total:
            length = min(sc.max_model_len, total - len(ids))
            spans.append(PrefillSpan(len(ids), length, length, None))
            ids += [0] * length
            positions += list(range(length))
        dev = self.device
        meta = AttentionMetadata(torch.zeros(len(ids), dtype=torch.long, device=dev), spans)
        rows = [i % len(ids) for i in range(min(sc.max_num_seqs, len(ids)))]
        batch = _Batch(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta,
                       rows)
        self._forward(batch, None)
        clear_expert_load(self.model)  # dummy tokens: no part of the expert load


def _accept_drafts(draft: list[int], drawn: list[int]) -> list[int]:
    """The tokens a decode with drafts emits: drawn[j] is the token the target model drew at
    draft position j (drawn[-1] after the whole draft). Emits drawn[0], and drawn[j + 1] as
    long as drawn[j] equalled draft[j], i.e. the longest accepted prefix and then the
    target's own token. Each drawn token is exactly the target's draw given the tokens before
    it, so this is rejection sampling (Leviathan et al. 2023) for a one-hot draft (an n-gram
    proposal): draft token x is kept with probability p(x), and otherwise the token is drawn
    from p with x removed, renormalized. Greedy and seeded requests emit what they would emit
    without speculation."""
    emitted = [drawn[0]]
    for j, token in enumerate(draft):
        if drawn[j] != token:
            break
        emitted.append(drawn[j + 1])
    return emitted


def _slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions [start, end) of a sequence with this block table (a loop over
    blocks, not tokens)."""
    out: list[int] = []
    for i in range(start // block_size, (end + block_size - 1) // block_size):
        base = table[i] * block_size
        out += range(base + max(start - i * block_size, 0),
                     base + min(end - i * block_size, block_size))
    return out
