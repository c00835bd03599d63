"""Scheduler: budgets, chunked prefill, priorities, preemption, abort and ignore.

`FakeEngine` plays the engine's part of the step loop (`complete_step`, sample a token when
do_sample, fork n > 1 requests, finish after max_tokens) and keeps
a fake KV cache: every step it applies the swaps and copies the scheduler asked for, writes
each scheduled token into the slot its block table names, and checks that every scheduled
sequence reads back its own tokens. A block handed to two owners, a lost swap or a missed
copy-on-write fails there.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from fleetllm.config import CacheConfig, SchedulerConfig
from fleetllm.core.scheduler import Scheduler, SchedulerOutputs
from fleetllm.sampling_params import SamplingParams
from fleetllm.sequence import Sequence, SequenceGroup, SequenceStatus

_ids = itertools.count(1)


def make_scheduler(block_size=4, gpu=64, cpu=64, max_tokens=64, max_seqs=16, mode="recompute"):
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                                     preemption_mode=mode),
                     CacheConfig(block_size=block_size, num_gpu_blocks=gpu, num_cpu_blocks=cpu))


def make_group(rid: str, prompt_len: int, max_tokens: int = 4, n: int = 1,
               arrival: float = 1.0) -> SequenceGroup:
    prompt = [hash((rid, i)) % 50_000 for i in range(prompt_len)]
    return SequenceGroup(rid, [Sequence(next(_ids), None, prompt)],
                         SamplingParams(n=n, max_tokens=max_tokens), arrival_time=arrival)


def sampled_token(seq: Sequence) -> int:
    return 100_000 * seq.seq_id + seq.get_len()  # unique per sequence and position


class FakeEngine:
    def __init__(self, scheduler: Scheduler):
        self.sched = scheduler
        self.bs = scheduler.block_manager.block_size
        self.gpu: dict[tuple[int, int], int] = {}
        self.cpu: dict[tuple[int, int], int] = {}
        self.first_scheduled: list[str] = []
        self.finished: list[str] = []
        self.in_prompt: dict[str, bool] = {}  # the stage each request must be sent with
        self.steps = 0

    def add(self, group: SequenceGroup) -> SequenceGroup:
        self.sched.add_seq_group(group)
        return group

    def _copy(self, src_mem, dst_mem, pairs) -> None:
        for src, dst in pairs:
            for slot in range(self.bs):
                dst_mem[(dst, slot)] = src_mem.get((src, slot))

    def step(self) -> SchedulerOutputs:
        waiting = {g.request_id for g in self.sched.waiting}
        metas, out = self.sched.schedule()
        self.steps += 1
        cfg = self.sched.config
        assert len(metas) == len(out.scheduled_seq_groups)
        tokens = sum(s.token_chunk_size * len(m.seq_data)
                     for s, m in zip(out.scheduled_seq_groups, metas, strict=True))
        assert tokens == out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert sum(len(m.seq_data) for m in metas) <= cfg.max_num_seqs
        assert len({m.request_id for m in metas}) == len(metas)
        # The worker's order: swap out, swap in, copy; then the forward pass.
        self._copy(self.gpu, self.cpu, out.blocks_to_swap_out.items())
        self._copy(self.cpu, self.gpu, out.blocks_to_swap_in.items())
        self._copy(self.gpu, self.gpu, [(s, d) for s, ds in out.blocks_to_copy.items()
                                        for d in ds])
        spans = []
        for meta, sched in zip(metas, out.scheduled_seq_groups, strict=True):
            assert meta.request_id == sched.seq_group.request_id
            assert meta.token_chunk_size == sched.token_chunk_size
            seqs = {s.seq_id: s for s in sched.seq_group.seqs}
            for seq_id, data in meta.seq_data.items():
                assert data is seqs[seq_id].data and seqs[seq_id].status == SequenceStatus.RUNNING
                start = data.num_computed_tokens
                end = start + meta.token_chunk_size
                assert end <= data.get_len()
                assert meta.do_sample == (end == data.get_len())
                if meta.request_id in waiting:  # admitted, or recomputed after preemption
                    self.in_prompt[meta.request_id] = True  # (from a cached prefix, maybe)
                # The stage is the scheduler's record, not a guess from token counts: a
                # final prompt chunk of one token is still a prompt step.
                assert meta.is_prompt == self.in_prompt[meta.request_id]
                table = meta.block_tables[seq_id]
                for p in range(start, end):  # the forward pass writes all new K/V first...
                    self.gpu[(table[p // self.bs], p % self.bs)] = data.token_at(p)
                spans.append((table, data, end))
        for table, data, end in spans:  # ...then attention reads each sequence's context
            got = [self.gpu.get((table[p // self.bs], p % self.bs)) for p in range(end)]
            assert got == data.all_token_ids[:end], "a sequence read someone else's K/V"
        self.sched.complete_step(out)
        for sched in out.scheduled_seq_groups:
            if sched.do_sample:
                self.in_prompt[sched.seq_group.request_id] = False
            self._advance(sched.seq_group, sched.do_sample)
            if sched.seq_group.request_id not in self.first_scheduled:
                self.first_scheduled.append(sched.seq_group.request_id)
        self.finished += self.sched.free_finished_seq_groups()
        return out

    def _advance(self, group: SequenceGroup, do_sample: bool) -> None:
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        if not do_sample:
            return
        params = group.sampling_params
        if params.n > 1 and len(group.seqs) == 1 and not seqs[0].output_token_ids:
            for index in range(1, params.n):  # fork after the prompt: share its blocks
                child = seqs[0].fork(next(_ids), sample_index=index)
                self.sched.fork_seq(seqs[0], child)
                group.seqs.append(child)
            seqs = group.seqs
        for seq in seqs:
            seq.append_token(sampled_token(seq), {})
            if len(seq.output_token_ids) >= params.max_tokens:
                seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                self.sched.free_seq(seq)

    def run(self, max_steps: int = 10_000) -> None:
        while self.sched.has_unfinished_seqs():
            self.step()
            assert self.steps < max_steps, "scheduler made no progress"


def assert_completed(group: SequenceGroup) -> None:
    """Every sequence got exactly max_tokens tokens, each sampled once, in order."""
    for seq in group.seqs:
        p = len(seq.prompt_token_ids)
        want = [100_000 * seq.seq_id + pos
                for pos in range(p, p + group.sampling_params.max_tokens)]
        assert seq.output_token_ids == want, group.request_id
        assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED
    assert len(group.seqs) == group.sampling_params.n


def assert_all_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert bm.num_free_gpu_blocks == bm.num_gpu_blocks
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks
    assert not bm.block_tables and not bm.cpu_tables


def test_chunked_prefill_of_long_prompt():
    engine = FakeEngine(make_scheduler(gpu=128, max_tokens=64))
    group = engine.add(make_group("long", 300, max_tokens=3))
    chunks, samples = [], []
    for _ in range(5):
        out = engine.step()
        (sched,) = out.scheduled_seq_groups
        chunks.append(sched.token_chunk_size)
        samples.append(sched.do_sample)
    assert chunks == [64, 64, 64, 64, 44]
    assert samples == [False] * 4 + [True]
    assert len(group.seqs[0].output_token_ids) == 1
    engine.run()
    assert_completed(group)
    assert engine.finished == ["long"]
    assert_all_free(engine.sched)


def test_decodes_go_before_prefills_and_budget_holds():
    engine = FakeEngine(make_scheduler(gpu=256, max_tokens=64))
    short = engine.add(make_group("short", 4, max_tokens=30, arrival=2.0))
    engine.step()  # short's prompt in one chunk; it decodes from now on
    # An older request with a long prompt: it sorts ahead of `short` in the running queue,
    # yet the decode's token is reserved before the prefill chunk is sized.
    long = engine.add(make_group("long", 400, max_tokens=2, arrival=1.0))
    while long.seqs[0].data.num_uncomputed_tokens() > 1:
        out = engine.step()
        sizes = {s.seq_group.request_id: s.token_chunk_size for s in out.scheduled_seq_groups}
        assert sizes["short"] == 1, "the running decode was starved by a prefill"
        assert out.num_batched_tokens <= 64
    engine.run()
    assert_completed(short)
    assert_completed(long)


def test_running_decodes_scheduled_before_new_prefills():
    engine = FakeEngine(make_scheduler(gpu=256, max_tokens=16, max_seqs=4))
    first = [engine.add(make_group(f"a{i}", 3, max_tokens=20)) for i in range(4)]
    engine.step()
    later = engine.add(make_group("late", 10, max_tokens=2))
    for _ in range(5):  # max_num_seqs is full of decodes: the newcomer waits
        out = engine.step()
        assert [s.seq_group.request_id for s in out.scheduled_seq_groups] == \
            ["a0", "a1", "a2", "a3"]
        assert all(s.token_chunk_size == 1 for s in out.scheduled_seq_groups)
    assert later.seqs[0].status == SequenceStatus.WAITING
    engine.run()
    for group in [*first, later]:
        assert_completed(group)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_many_requests_with_preemption_all_complete(mode):
    rng = random.Random(7)
    engine = FakeEngine(make_scheduler(block_size=4, gpu=24, cpu=64, max_tokens=48,
                                       max_seqs=8, mode=mode))
    groups = []
    for i in range(200):
        n = 2 if i % 10 == 3 else 1
        groups.append(engine.add(make_group(f"r{i}", rng.randint(1, 30), rng.randint(1, 12),
                                            n=n, arrival=float(i + 1))))
        if i % 20 == 19:  # requests keep arriving while others run
            for _ in range(rng.randint(0, 6)):
                engine.step()
    engine.run()
    assert engine.sched.num_preemptions > 0
    for group in groups:
        assert_completed(group)
    assert Counter(engine.finished) == Counter(g.request_id for g in groups)
    assert sorted(engine.first_scheduled, key=lambda r: int(r[1:])) == engine.first_scheduled
    assert_all_free(engine.sched)


def _fill_pool(mode: str):
    """Two requests whose decodes outgrow a 4-block pool, and a third waiting behind."""
    engine = FakeEngine(make_scheduler(block_size=4, gpu=4, cpu=8, mode=mode))
    a = engine.add(make_group("a", 4, max_tokens=8, arrival=1.0))
    b = engine.add(make_group("b", 4, max_tokens=8, arrival=2.0))
    engine.step()
    engine.step()  # both now hold 2 blocks: the pool is full
    c = engine.add(make_group("c", 4, max_tokens=2, arrival=3.0))
    while True:
        out = engine.step()
        if out.preempted:
            return engine, out, a, b, c


def test_recompute_preemption_requeues_newest_at_front():
    engine, out, a, b, c = _fill_pool("recompute")
    assert out.preempted == 1 and engine.sched.num_preemptions == 1
    assert [s.seq_group.request_id for s in out.scheduled_seq_groups] == ["a"]
    assert not out.blocks_to_swap_out
    assert list(engine.sched.waiting) == [b, c]  # the victim goes ahead of newer requests
    seq = b.seqs[0]
    assert seq.status == SequenceStatus.WAITING and seq.data.num_computed_tokens == 0
    assert len(seq.output_token_ids) == 5  # its outputs are kept and recomputed as prompt
    assert seq.seq_id not in engine.sched.block_manager.block_tables
    engine.run()
    for group in (a, b, c):
        assert_completed(group)
    assert engine.first_scheduled == ["a", "b", "c"]
    assert_all_free(engine.sched)


def test_swap_preemption_round_trip():
    engine, out, a, b, c = _fill_pool("swap")
    assert out.preempted == 1 and len(out.blocks_to_swap_out) == 2
    assert list(engine.sched.swapped) == [b] and b.seqs[0].status == SequenceStatus.SWAPPED
    assert b.seqs[0].data.num_computed_tokens == 8  # kept: nothing is recomputed
    while not out.blocks_to_swap_in:
        assert c.seqs[0].status == SequenceStatus.WAITING  # a swapped group goes first
        out = engine.step()
    assert [s.seq_group for s in out.scheduled_seq_groups][0] is b
    assert b.seqs[0].status == SequenceStatus.RUNNING
    engine.run()
    for group in (a, b, c):
        assert_completed(group)
    assert_all_free(engine.sched)


def test_multi_sequence_group_is_swapped_even_in_recompute_mode_else_recomputed():
    # "pair" alone needs 9 blocks at its longest (a shared prompt block + 4 each), "old" 4.
    engine = FakeEngine(make_scheduler(block_size=4, gpu=10, cpu=16))
    engine.add(make_group("old", 4, max_tokens=12, arrival=1.0))
    pair = engine.add(make_group("pair", 5, max_tokens=12, n=2, arrival=2.0))
    out = engine.step()
    while not out.preempted:
        out = engine.step()
    assert list(engine.sched.swapped) == [pair] and out.blocks_to_swap_out
    engine.run()
    assert_completed(pair)

    # No CPU pool: the pair is recomputed, both samples (2 x 5 blocks unshared fit in 10).
    no_cpu = FakeEngine(make_scheduler(block_size=4, gpu=10, cpu=0))
    old = no_cpu.add(make_group("old", 4, max_tokens=12, arrival=1.0))
    pair = no_cpu.add(make_group("pair", 5, max_tokens=12, n=2, arrival=2.0))
    no_cpu.run()
    assert no_cpu.sched.num_preemptions > 0 and not no_cpu.sched.swapped
    assert_completed(old)
    assert_completed(pair)
    assert_all_free(no_cpu.sched)


def test_abort_frees_every_block():
    engine = FakeEngine(make_scheduler(block_size=4, gpu=10, cpu=16, max_tokens=16,
                                       mode="swap"))
    groups = [engine.add(make_group(f"r{i}", 6, max_tokens=20, n=1 + i % 2,
                                    arrival=float(i + 1))) for i in range(6)]
    for _ in range(12):
        engine.step()
    sched = engine.sched
    assert sched.running and sched.waiting and sched.swapped  # something in every queue
    sched.abort_seq_group("r0")
    sched.abort_seq_group(g.request_id for g in groups[1:])
    assert not sched.has_unfinished_seqs() and sched.get_num_unfinished_seq_groups() == 0
    assert_all_free(sched)
    for group in groups:
        assert all(s.status == SequenceStatus.FINISHED_ABORTED for s in group.seqs)
    assert sched.free_finished_seq_groups() == []  # the engine tracks aborted ids itself
    assert sched.schedule()[1].is_empty


def test_oversized_request_is_ignored_and_others_complete():
    engine = FakeEngine(make_scheduler(block_size=4, gpu=8, max_seqs=4))
    before = engine.add(make_group("before", 5, arrival=1.0))
    huge = engine.add(make_group("huge", 33, arrival=2.0))  # 9 blocks > the whole pool
    wide = engine.add(make_group("wide", 3, n=5, arrival=3.0))  # n > max_num_seqs
    after = engine.add(make_group("after", 5, arrival=4.0))
    out = engine.step()
    assert out.ignored_seq_groups == [huge, wide]
    assert all(s.status == SequenceStatus.FINISHED_IGNORED for s in huge.seqs + wide.seqs)
    assert [s.seq_group for s in out.scheduled_seq_groups] == [before, after]
    engine.run()
    assert_completed(before)
    assert_completed(after)
    assert_all_free(engine.sched)


def test_fcfs_first_scheduling_and_metrics():
    rng = random.Random(1)
    engine = FakeEngine(make_scheduler(block_size=4, gpu=40, max_tokens=32, max_seqs=4))
    groups = [engine.add(make_group(f"r{i}", rng.randint(1, 40), rng.randint(1, 6),
                                    arrival=float(i + 1))) for i in range(30)]
    engine.run()
    assert engine.first_scheduled == [g.request_id for g in groups]
    for group in groups:
        assert_completed(group)
        m = group.metrics
        assert m.first_scheduled_time is not None and m.time_in_queue == pytest.approx(
            m.first_scheduled_time - m.arrival_time)


def test_metadata_passes_data_and_copies_tables():
    sched = make_scheduler()
    group = make_group("r", 10)
    sched.add_seq_group(group)
    metas, out = sched.schedule()
    (meta,) = metas
    seq = group.seqs[0]
    assert meta.is_prompt and meta.do_sample and meta.token_chunk_size == 10
    assert meta.seq_data[seq.seq_id] is seq.data
    assert meta.sampling_params is group.sampling_params
    table = sched.block_manager.get_block_table(seq)
    assert meta.block_tables[seq.seq_id] == table and meta.block_tables[seq.seq_id] is not table
    assert out.running_queue_size == 1 and not out.is_empty
    assert seq.data.num_computed_tokens == 0  # the engine advances it, not the scheduler


def test_victim_is_the_newest_running_group():
    engine = FakeEngine(make_scheduler(block_size=4, gpu=6))
    a, b, c = (engine.add(make_group(r, 4, max_tokens=8, arrival=float(i + 1)))
               for i, r in enumerate("abc"))
    out = engine.step()
    while not out.preempted:  # all three cross into their third block at once: one must go
        out = engine.step()
    assert out.preempted == 1 and list(engine.sched.waiting) == [c]
    assert [s.seq_group for s in out.scheduled_seq_groups] == [a, b]
    engine.run()
    for group in (a, b, c):
        assert_completed(group)
