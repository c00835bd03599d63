"""Continuous-batching scheduler with chunked prefill and preemption.

Each step, within max_num_batched_tokens and max_num_seqs: running groups first, oldest first
(decode tokens reserved before prefill chunks; when blocks run out the newest are preempted:
recomputed, or swapped where the CPU pool has room); then, if nothing was preempted, swapped
groups back in; then waiting groups FCFS until one does not fit (one still compiling its
grammar is passed over, keeping its place). Decoding sequences also get num_lookahead_slots
for drafts or multi-step passes (`advance_computed`).
`schedule()` only plans; the engine calls `complete_step()` after the workers ran, or
`requeue_after_failed_step()` after a failure, which leaves every group as before the step
except those whose blocks it copied or swapped (they are recomputed): no token is lost.
With a KV connector (fleetllm/kv_transfer), a waiting group's prefix may also come from an
external store past its local prefix-cache hit (`get_num_new_matched_tokens`): those blocks
are allocated and count as computed; the workers load them before the step's forward. A load
that failed (`drop_failed_loads`) is recomputed or ends the request (kv_load_failure_policy).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from fleetllm.config import CacheConfig, SchedulerConfig
from fleetllm.config_lora import LoRAConfig
from fleetllm.core.block_manager import BlockManager
from fleetllm.core.scheduler_kv import KVTransferMixin
from fleetllm.core.scheduler_output import ScheduledSequenceGroup, SchedulerOutputs
from fleetllm.kv_transfer.base import KVConnectorBase_V1
from fleetllm.sequence import Sequence, SequenceGroup, SequenceGroupMetadata, SequenceStatus


@dataclass
class _Budget:
    max_tokens: int
    max_seqs: int
    tokens: int = 0
    seqs: int = 0
    max_loras: int = 0  # distinct LoRA adapters a step may use (0: LoRA is off)
    loras: set[int] = field(default_factory=set)

    @property
    def tokens_left(self) -> int:
        return self.max_tokens - self.tokens

    def fits_seqs(self, n: int) -> bool:
        return self.seqs + n <= self.max_seqs

    def fits_lora(self, group: SequenceGroup) -> bool:
        """The group's adapter is one of the step's already, or there is room for one more
        (the workers have max_loras device slots)."""
        lora = group.lora_request
        return lora is None or lora.lora_int_id in self.loras or \
            len(self.loras) < self.max_loras


def _by_arrival(queue: Iterable[SequenceGroup]) -> deque[SequenceGroup]:
    return deque(sorted(queue, key=lambda g: g.arrival_time))  # stable: ties keep order


class Scheduler(KVTransferMixin):
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 lora_config: LoRAConfig | None = None,
                 kv_connector: KVConnectorBase_V1 | None = None,
                 kv_load_failure_policy: str = "recompute"):
        if cache_config.num_gpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks must be measured before the "
                             "scheduler is built")
        self.config = scheduler_config
        self.max_loras = 0 if lora_config is None else lora_config.max_loras
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.block_manager = BlockManager(cache_config.block_size, cache_config.num_gpu_blocks,
                                          cache_config.num_cpu_blocks or 0,
                                          cache_config.enable_prefix_caching)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = 0
        self._finished_ids: list[str] = []  # finished while running; see free_finished_...
        # KV transfer: the connector's scheduler half, and what it did.
        self.kv_connector = kv_connector
        self.kv_load_failure_policy = kv_load_failure_policy
        if kv_connector is not None:
            kv_connector.block_manager = self.block_manager
        self.num_kv_load_failures = 0  # requests whose external load failed
        self.finished_kv_transfer_params: dict[str, dict] = {}  # scheduler_kv.py
        self.num_prompt_tokens_computed = 0  # prefill tokens the workers computed

    # ------------------------------------------------------------------ queue API

    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        self.waiting.append(seq_group)

    def abort_seq_group(self, request_id: str | Iterable[str]) -> None:
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        for queue in (self.waiting, self.running, self.swapped):
            for group in [g for g in queue if g.request_id in ids]:
                queue.remove(group)
                self._connector_finished(group)
                for seq in group.seqs:
                    if not seq.is_finished():
                        seq.status = SequenceStatus.FINISHED_ABORTED
                    self.block_manager.free(seq)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        self.block_manager.fork(parent, child)

    def free_seq(self, seq: Sequence) -> None:
        self.block_manager.free(seq)

    def free_finished_seq_groups(self) -> list[str]:
        """Drop finished groups from running, free their blocks, and return the ids of those
        that finished running since the last call (not aborted or ignored ones)."""
        self._reap_finished()
        ids, self._finished_ids = self._finished_ids, []
        return ids

    def advance_computed(self, seq: Sequence, num_tokens: int) -> None:
        """The step also cached the K/V of `num_tokens` more tokens of `seq` than its chunk
        (accepted drafts of speculative decoding, later passes of multi-step decoding); full
        blocks become findable."""
        seq.data.num_computed_tokens += num_tokens
        self.block_manager.mark_computed(seq)

    def complete_step(self, out: SchedulerOutputs) -> None:
        """The workers ran `out`: its chunks are cached now; a group that sampled has left the
        prefill stage. (Call before appending the sampled tokens.)"""
        for scheduled in out.scheduled_seq_groups:
            group = scheduled.seq_group
            if group.is_prefill():
                self.num_prompt_tokens_computed += scheduled.token_chunk_size
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.data.num_computed_tokens += scheduled.token_chunk_size
                self.block_manager.mark_computed(seq)  # full blocks become findable
            if scheduled.do_sample:
                group.in_prefill = False

    def requeue_after_failed_step(self, out: SchedulerOutputs) -> None:
        """The step `out` failed. Groups whose blocks it copied or moved drop their KV and
        wait to be recomputed (their tokens are kept); all others stay as they are."""
        moved = {id(g): g for g in out.kv_moved if not g.is_finished()}
        for queue in (self.running, self.swapped):
            for group in [g for g in queue if id(g) in moved]:
                queue.remove(group)
        for group in moved.values():
            self._reset_for_recompute(group)
            self.waiting.append(group)
        self.waiting = _by_arrival(self.waiting)

    def recompute_all(self) -> None:
        """The workers were replaced: every KV block, the swap pool's too, is gone. Running
        and swapped groups wait to be recomputed from their tokens."""
        for group in [*self.running, *self.swapped]:
            self._reset_for_recompute(group)
            self.waiting.append(group)
        self.running.clear()
        self.swapped.clear()
        self.block_manager.reset_prefix_cache()  # cached prefixes went with the old KV
        self.waiting = _by_arrival(self.waiting)

    def fail_group(self, group: SequenceGroup, why: str) -> None:
        """End a group that can never run (finish_reason "error", `group.error` = why)."""
        for queue in (self.waiting, self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        self._ignore(group, SchedulerOutputs(), why)

    def _reset_for_recompute(self, group: SequenceGroup) -> None:
        for seq in group.unfinished_seqs():
            self.block_manager.free(seq)
            seq.status = SequenceStatus.WAITING
            seq.data.num_computed_tokens = 0
        group.in_prefill = True

    def _reap_finished(self) -> None:
        kept: deque[SequenceGroup] = deque()
        for group in self.running:
            for seq in group.seqs:
                if seq.is_finished():  # free_seq is idempotent; catch any the engine missed
                    self.block_manager.free(seq)
            if group.is_finished():
                self._connector_finished(group)
                self._finished_ids.append(group.request_id)
            else:
                kept.append(group)
        self.running = kept

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> tuple[list[SequenceGroupMetadata], SchedulerOutputs]:
        self._reap_finished()
        out = SchedulerOutputs()
        budget = _Budget(self.max_num_batched_tokens, self.config.max_num_seqs,
                         max_loras=self.max_loras)
        metadata: list[SequenceGroupMetadata] = []
        self._schedule_running(out, budget, metadata)
        if not out.preempted:
            self._schedule_swapped(out, budget, metadata)
            if not self.swapped:  # swapped groups are older: they go before new ones
                self._schedule_waiting(out, budget, metadata)
        out.num_batched_tokens = budget.tokens
        out.running_queue_size = len(self.running)
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_connector_meta(out)
        return metadata, out

    def _schedule_running(self, out: SchedulerOutputs, budget: _Budget,
                          metadata: list[SequenceGroupMetadata]) -> None:
        self.running = _by_arrival(self.running)
        # Decode tokens of the whole queue are reserved before any prefill chunk is sized.
        reserved = sum(len(g.unfinished_seqs()) for g in self.running if not g.is_prefill())
        kept: deque[SequenceGroup] = deque()
        while self.running:
            group = self.running.popleft()
            n = len(group.unfinished_seqs())
            if group.is_prefill():
                chunk = self._whole(group, min(self._uncomputed(group),
                                               (budget.tokens_left - reserved) // n))
            else:
                reserved -= n
                chunk = 1 if n <= budget.tokens_left else 0
            if chunk <= 0 or not budget.fits_seqs(n) or not budget.fits_lora(group):
                kept.append(group)  # keeps its blocks; runs in a later step
                continue
            # Make room by preempting from the back; the else branch runs when it fits.
            lookahead = self._lookahead(group)
            while not self.block_manager.can_ensure(group, chunk + lookahead):
                if not self.running:  # it is the lowest priority itself
                    if lookahead and self.block_manager.can_ensure(group, chunk):
                        lookahead = 0  # no room for lookahead: this step without it
                        continue
                    self._preempt(group, out)
                    break
                victim = self.running.pop()
                if not victim.is_prefill():
                    reserved -= len(victim.unfinished_seqs())
                self._preempt(victim, out)
            else:
                self._schedule_group(group, chunk, n, out, budget, metadata, lookahead)
                kept.append(group)
        self.running = kept

    def _schedule_swapped(self, out: SchedulerOutputs, budget: _Budget,
                          metadata: list[SequenceGroupMetadata]) -> None:
        bm = self.block_manager
        self.swapped = _by_arrival(self.swapped)
        while self.swapped:
            group = self.swapped[0]
            n = len(group.unfinished_seqs())
            chunk = self._whole(group, min(self._uncomputed(group), budget.tokens_left // n))
            if bm.num_required_blocks(group, max(chunk, 1)) > bm.num_gpu_blocks:
                self._ignore(self.swapped.popleft(), out, "its KV blocks no longer fit in "
                             f"the whole pool of {bm.num_gpu_blocks} blocks")
                continue
            # Lookahead slots if they fit (a pool too small for them must not strand it).
            lookahead = self._lookahead(group)
            if not bm.can_swap_in(group, chunk + lookahead):
                lookahead = 0
            if chunk <= 0 or not budget.fits_seqs(n) or not budget.fits_lora(group) or \
                    not bm.can_swap_in(group, chunk + lookahead):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.update(bm.swap_in(group))
            out.kv_moved.append(group)
            for seq in group.unfinished_seqs():
                seq.status = SequenceStatus.RUNNING
            self._schedule_group(group, chunk, n, out, budget, metadata, lookahead)
            self.running.append(group)

    def _schedule_waiting(self, out: SchedulerOutputs, budget: _Budget,
                          metadata: list[SequenceGroupMetadata]) -> None:
        bm = self.block_manager
        # Passed over, keeping their place at the head of the queue: groups whose grammar
        # is still compiling, and groups whose adapter would exceed the step's max_loras.
        passed: list[SequenceGroup] = []
        while self.waiting:
            group = self.waiting[0]
            if group.grammar is not None:
                if not group.grammar.ready:
                    passed.append(self.waiting.popleft())
                    continue
                if group.grammar.error() is not None:
                    self._ignore(self.waiting.popleft(), out, "its structured output "
                                 f"constraint does not compile: {group.grammar.error()}")
                    continue
            if not budget.fits_lora(group):
                passed.append(self.waiting.popleft())
                continue
            seqs = group.unfinished_seqs()
            width = group.max_num_running_seqs()
            need = len(seqs) * bm.num_blocks_for(seqs[0].get_len())
            if width > self.config.max_num_seqs or need > bm.num_gpu_blocks:
                self._ignore(self.waiting.popleft(), out,  # could never be scheduled
                             f"{width} sequences of {seqs[0].get_len()} tokens need {need} KV "
                             f"blocks and {width} of max_num_seqs={self.config.max_num_seqs}; "
                             f"the pool has {bm.num_gpu_blocks} blocks")
                continue
            # Its longest cached prefix counts as computed; not for prompt logprobs or pooling,
            # which need every prompt position's logits (hidden states).
            reuse = group.sampling_params.prompt_logprobs is None and \
                group.pooling_params is None
            hits = bm.prefix_hits(group) if reuse else []
            external = self._external_tokens(group, len(hits)) if reuse else 0
            uncomputed = self._uncomputed(group) - len(hits) * bm.block_size - external
            chunk = self._whole(group, min(uncomputed, budget.tokens_left // len(seqs)))
            if chunk <= 0 or not budget.fits_seqs(width) or \
                    not bm.can_take_prefix(group, hits, chunk, external):
                break  # FCFS: nothing overtakes the head of the queue
            self.waiting.popleft()
            bm.take_prefix(group, hits, external)
            if external:  # loaded before the forward: a failed step leaves them unknown
                out.kv_moved.append(group)
            if self.kv_connector is not None:
                self.kv_connector.update_state_after_alloc(
                    group, list(bm.get_block_table(seqs[0])), external)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            self._schedule_group(group, chunk, width, out, budget, metadata)
            self.running.append(group)
        self.waiting.extendleft(reversed(passed))

    def waiting_for_grammars(self) -> list[SequenceGroup]:
        return [g for g in self.waiting if g.grammar is not None and not g.grammar.ready]

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _uncomputed(group: SequenceGroup) -> int:
        # The seqs of a group advance together; a decode has exactly one uncomputed token.
        return max(s.data.num_uncomputed_tokens() for s in group.unfinished_seqs())

    def _lookahead(self, group: SequenceGroup) -> int:
        """Slots a decoding group's sequences hold past their next token (drafts, multi-step
        passes; a prefill has none). Unused ones stay in its table, rewritten by the next step
        and freed with it. Never worth preempting the group itself: when only its next token
        fits, it runs without them, and the workers draft (or pass) only as far as it reaches."""
        return 0 if group.is_prefill() else self.config.num_lookahead_slots

    def _whole(self, group: SequenceGroup, chunk: int) -> int:
        """A pooling prompt is never chunked (its vector needs every token's hidden state in
        one forward): all of it, or 0 (it waits for a step with room; the engine refuses
        prompts longer than the token budget)."""
        if group.pooling_params is not None and chunk < self._uncomputed(group):
            return 0
        return chunk

    def _schedule_group(self, group: SequenceGroup, chunk: int, num_seqs: int,
                        out: SchedulerOutputs, budget: _Budget,
                        metadata: list[SequenceGroupMetadata], lookahead: int = 0) -> None:
        seqs = group.unfinished_seqs()
        tables = {}
        for seq in seqs:
            cows = self.block_manager.ensure_slots(
                seq, seq.data.num_computed_tokens + chunk + lookahead)
            for src, dst in cows:
                out.blocks_to_copy.setdefault(src, []).append(dst)
            if cows and group not in out.kv_moved:
                out.kv_moved.append(group)
            tables[seq.seq_id] = list(self.block_manager.get_block_table(seq))
        data = seqs[0].data
        do_sample = data.num_computed_tokens + chunk == data.get_len()
        out.scheduled_seq_groups.append(ScheduledSequenceGroup(group, chunk, do_sample))
        budget.tokens += chunk * len(seqs)
        budget.seqs += num_seqs
        if group.lora_request is not None:
            budget.loras.add(group.lora_request.lora_int_id)
        metadata.append(SequenceGroupMetadata(
            request_id=group.request_id, is_prompt=group.is_prefill(),
            seq_data={s.seq_id: s.data for s in seqs}, sampling_params=group.sampling_params,
            block_tables=tables, token_chunk_size=chunk, do_sample=do_sample,
            pooling_params=group.pooling_params, lora_request=group.lora_request))
        if group.metrics.first_scheduled_time is None:
            now = time.time()
            group.metrics.first_scheduled_time = now
            group.metrics.time_in_queue = now - group.arrival_time

    def _preempt(self, group: SequenceGroup, out: SchedulerOutputs) -> None:
        seqs = group.unfinished_seqs()
        # Forked samples prefer swapping (they keep sharing their prompt blocks); anything
        # falls back to recompute when the CPU pool cannot take it.
        swap = (len(seqs) > 1 or self.config.preemption_mode == "swap") and \
            self.block_manager.can_swap_out(group)
        if swap:
            out.blocks_to_swap_out.update(self.block_manager.swap_out(group))
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            out.kv_moved.append(group)
        else:  # recompute: drop the cache; the prompt and outputs are prefilled again later
            self._reset_for_recompute(group)
            self.waiting.appendleft(group)
        out.preempted += 1
        self.num_preemptions += 1

    def _ignore(self, group: SequenceGroup, out: SchedulerOutputs, why: str) -> None:
        group.error = f"request {group.request_id} cannot be scheduled: {why}"
        self._connector_finished(group)
        for seq in group.seqs:
            if not seq.is_finished():
                seq.status = SequenceStatus.FINISHED_IGNORED
            self.block_manager.free(seq)
        out.ignored_seq_groups.append(group)
