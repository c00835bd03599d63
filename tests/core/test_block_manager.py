"""BlockManager: refcounts, copy-on-write, swapping, and a randomized no-double-ownership run.

The randomized test keeps a fake KV cache (a dict per pool) and applies every copy/swap the
manager asks for, so a wrong table, a missed copy-on-write or a bad swap mapping shows up as a
sequence reading back a token that is not its own.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from fleetllm.core.block_manager import BlockManager
from fleetllm.errors import OutOfMemoryError
from fleetllm.sampling_params import SamplingParams
from fleetllm.sequence import Sequence, SequenceGroup, SequenceStatus

_ids = itertools.count(1)


def make_group(num_tokens: int, rid: str = "r") -> SequenceGroup:
    seq = Sequence(next(_ids), None, [1000 * len(rid) + i for i in range(num_tokens)])
    return SequenceGroup(rid, [seq], SamplingParams(), arrival_time=1.0)


def fork_into(bm: BlockManager, group: SequenceGroup, parent: Sequence) -> Sequence:
    child = parent.fork(next(_ids), sample_index=1)
    bm.fork(parent, child)
    group.seqs.append(child)
    return child


def check_invariants(bm: BlockManager) -> None:
    """Refcount == references from tables; free list == exactly the unreferenced blocks."""
    for pool, tables in ((bm.gpu, bm.block_tables), (bm.cpu, bm.cpu_tables)):
        refs = Counter(b for table in tables.values() for b in table)
        assert len(pool.free) == len(set(pool.free)), "a block is twice on the free list"
        for block in range(pool.num_blocks):
            assert pool.ref[block] == refs[block], (pool.name, block)
            assert (block in pool.free) == (refs[block] == 0), (pool.name, block)
    assert not set(bm.block_tables) & set(bm.cpu_tables), "a seq is in both pools"


def test_lazy_allocation_and_usage():
    bm = BlockManager(block_size=4, num_gpu_blocks=10, num_cpu_blocks=5)
    group = make_group(10)
    seq = group.seqs[0]
    assert bm.can_allocate(group, 6)
    bm.allocate(group, 6)  # first chunk: 6 tokens -> 2 blocks, not the 3 the prompt needs
    assert len(bm.get_block_table(seq)) == 2
    assert bm.num_free_gpu_blocks == 8 and bm.gpu_usage == pytest.approx(0.2)
    seq.data.num_computed_tokens = 6
    assert bm.append_slots(seq, 4) == []
    assert len(bm.get_block_table(seq)) == 3
    assert not bm.can_allocate(make_group(33), None)  # 9 blocks > 7 free
    assert bm.cpu_usage == 0.0
    bm.free(seq)
    assert bm.num_free_gpu_blocks == 10 and bm.gpu_usage == 0.0
    check_invariants(bm)


def test_fork_shares_blocks_and_free_is_refcounted():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0)
    group = make_group(6)
    parent = group.seqs[0]
    bm.allocate(group)
    table = list(bm.get_block_table(parent))
    child = fork_into(bm, group, parent)
    assert bm.get_block_table(child) == table
    assert bm.get_block_table(child) is not bm.get_block_table(parent)
    assert [bm.gpu.ref[b] for b in table] == [2, 2]
    assert bm.num_free_gpu_blocks == 6  # sharing costs nothing
    bm.free(parent)
    assert [bm.gpu.ref[b] for b in table] == [1, 1] and bm.num_free_gpu_blocks == 6
    bm.free(child)
    assert bm.num_free_gpu_blocks == 8
    bm.free(child)  # idempotent, and unknown seqs are fine
    bm.free(Sequence(next(_ids), None, [1]))
    check_invariants(bm)


def test_copy_on_write_into_shared_partial_block():
    bm = BlockManager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=0)
    group = make_group(6)  # blocks: [full, partial (2 of 4 slots)]
    parent = group.seqs[0]
    bm.allocate(group)
    parent.data.num_computed_tokens = 6
    full, partial = bm.get_block_table(parent)
    kids = [fork_into(bm, group, parent) for _ in range(2)]
    for seq in group.seqs:
        seq.append_token(7, {})  # each writes position 6, inside the shared partial block
    assert bm.can_append_slots(group)
    assert bm.num_required_blocks(group, 1) == 2  # 3 holders: 2 copies, the last writes in place
    cows = [bm.append_slots(seq) for seq in group.seqs]
    assert cows[0] and cows[1] and cows[2] == []
    for (src, dst), seq in zip([c[0] for c in cows[:2]], group.seqs[:2], strict=True):
        assert src == partial and dst not in (full, partial)
        assert bm.get_block_table(seq) == [full, dst]
    assert bm.get_block_table(kids[1]) == [full, partial]
    assert bm.gpu.ref[full] == 3 and bm.gpu.ref[partial] == 1
    check_invariants(bm)
    for seq in group.seqs:
        seq.data.num_computed_tokens = 7
    # The pool is full: positions 7..8 cross into a new block per seq, none is left.
    assert bm.num_free_gpu_blocks == 0 and bm.can_ensure(group, 1)
    assert bm.num_required_blocks(group, 2) == 3 and not bm.can_ensure(group, 2)
    with pytest.raises(OutOfMemoryError):
        bm.append_slots(parent, 2)


def test_no_copy_when_shared_block_is_full():
    bm = BlockManager(block_size=4, num_gpu_blocks=6, num_cpu_blocks=0)
    group = make_group(8)
    parent = group.seqs[0]
    bm.allocate(group)
    parent.data.num_computed_tokens = 8
    child = fork_into(bm, group, parent)
    for seq in (parent, child):
        seq.append_token(1, {})
        assert bm.append_slots(seq) == []  # position 8 opens a new private block
    assert bm.get_block_table(parent)[:2] == bm.get_block_table(child)[:2]
    assert bm.get_block_table(parent)[2] != bm.get_block_table(child)[2]
    check_invariants(bm)


def _structure(tables: list[list[int]]) -> list[list[int]]:
    """Tables with each block replaced by the index of its first appearance: which positions
    share a block, independent of the block ids."""
    first: dict[int, int] = {}
    return [[first.setdefault(b, len(first)) for b in t] for t in tables]


def test_swap_round_trip_keeps_sharing():
    bm = BlockManager(block_size=4, num_gpu_blocks=12, num_cpu_blocks=6)
    group = make_group(9)
    parent = group.seqs[0]
    bm.allocate(group)
    parent.data.num_computed_tokens = 9
    kids = [fork_into(bm, group, parent) for _ in range(2)]
    for seq in group.seqs:
        seq.append_token(3, {})
        bm.append_slots(seq)
        seq.data.num_computed_tokens += 1
    seqs = [parent, *kids]
    before = [list(bm.get_block_table(s)) for s in seqs]
    distinct = {b for t in before for b in t}
    refs = {b: bm.gpu.ref[b] for b in distinct}
    assert len(distinct) == 5  # 2 shared prompt blocks + 3 private copies of the partial
    other = make_group(4, "other")
    bm.allocate(other)
    free_before = bm.num_free_gpu_blocks

    assert bm.can_swap_out(group)
    out = bm.swap_out(group)
    assert set(out) == distinct and len(set(out.values())) == len(distinct)  # each block once
    assert bm.num_free_gpu_blocks == free_before + len(distinct)
    assert bm.num_free_cpu_blocks == 6 - len(distinct)
    assert bm.cpu_usage == pytest.approx(len(distinct) / 6)
    assert {out[b]: r for b, r in refs.items()} == {c: bm.cpu.ref[c] for c in out.values()}
    cpu_tables = [bm.cpu_tables[s.seq_id] for s in seqs]
    assert cpu_tables == [[out[b] for b in t] for t in before]
    check_invariants(bm)

    assert bm.can_swap_in(group)
    back = bm.swap_in(group)
    assert set(back) == set(out.values())
    after = [list(bm.get_block_table(s)) for s in seqs]
    assert after == [[back[out[b]] for b in t] for t in before]
    assert _structure(after) == _structure(before)
    assert bm.num_free_cpu_blocks == 6 and bm.num_free_gpu_blocks == free_before
    check_invariants(bm)
    # Structure survives: the shared partial block was already split, the next write CoWs
    # nothing; the shared prompt blocks still count 3 holders.
    assert [bm.gpu.ref[b] for b in after[0][:2]] == [3, 3]

    small = BlockManager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=1)
    g2 = make_group(8)
    small.allocate(g2)
    assert not small.can_swap_out(g2)  # 2 blocks, 1 cpu block


def test_can_swap_in_counts_growth():
    bm = BlockManager(block_size=4, num_gpu_blocks=3, num_cpu_blocks=3)
    group = make_group(8)
    seq = group.seqs[0]
    bm.allocate(group)
    seq.data.num_computed_tokens = 8
    seq.append_token(1, {})
    bm.swap_out(group)
    seq.status = SequenceStatus.SWAPPED
    bm.allocate(make_group(4, "x"))  # leaves 2 free: the 2 blocks fit, the next token not
    assert bm.num_required_blocks(group, 1) == 3
    assert not bm.can_swap_in(group, 1)


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_ownership_and_contents(seed):
    rng = random.Random(seed)
    bs = 4
    bm = BlockManager(block_size=bs, num_gpu_blocks=24, num_cpu_blocks=16)
    gpu: dict[tuple[int, int], int] = {}  # fake KV cache: (block, slot) -> token
    cpu: dict[tuple[int, int], int] = {}
    resident: list[SequenceGroup] = []
    swapped: list[SequenceGroup] = []

    def copy(src_mem, dst_mem, mapping):
        for src, dst in mapping:
            for slot in range(bs):
                if (src, slot) in src_mem:
                    dst_mem[(dst, slot)] = src_mem[(src, slot)]
                else:
                    dst_mem.pop((dst, slot), None)

    def compute(group: SequenceGroup, n: int) -> None:
        """What a step does: CoW copies, then write K/V of n new tokens per seq."""
        for seq in group.unfinished_seqs():
            copy(gpu, gpu, bm.ensure_slots(seq, seq.data.num_computed_tokens + n))
        for seq in group.unfinished_seqs():
            table = bm.get_block_table(seq)
            for p in range(seq.data.num_computed_tokens, seq.data.num_computed_tokens + n):
                gpu[(table[p // bs], p % bs)] = seq.data.token_at(p)
            seq.data.num_computed_tokens += n

    def verify() -> None:
        check_invariants(bm)
        owner: dict[int, str] = {}
        for group in resident:
            for seq in group.unfinished_seqs():
                table = bm.get_block_table(seq)
                for p in range(seq.data.num_computed_tokens):
                    assert gpu[(table[p // bs], p % bs)] == seq.data.token_at(p), (seed, p)
                for b in table:  # only forks of one request may share a block
                    assert owner.setdefault(b, group.request_id) == group.request_id

    for step in range(400):
        op = rng.random()
        if op < 0.3 or not resident:  # new request, first chunk
            group = make_group(rng.randint(1, 14), f"r{step}")
            n = rng.randint(1, group.seqs[0].get_len())
            if bm.can_allocate(group, n):
                compute(group, n)
                resident.append(group)
        elif op < 0.6:  # decode or next chunk, after sampling when the prompt is done
            group = rng.choice(resident)
            for seq in group.unfinished_seqs():
                if seq.data.num_uncomputed_tokens() == 0:
                    seq.append_token(rng.randint(0, 99) + 100 * seq.seq_id, {})
            n = min(s.data.num_uncomputed_tokens() for s in group.unfinished_seqs())
            if bm.can_ensure(group, n):
                compute(group, n)
        elif op < 0.7:  # fork a fully computed sequence
            group = rng.choice(resident)
            parent = group.unfinished_seqs()[0]
            if parent.data.num_uncomputed_tokens() == 0 and len(group.seqs) < 4:
                fork_into(bm, group, parent)
        elif op < 0.8:  # finish one sequence or the whole request
            group = rng.choice(resident)
            seqs = group.unfinished_seqs()
            for seq in seqs if rng.random() < 0.5 or len(seqs) == 1 else seqs[:1]:
                seq.status = SequenceStatus.FINISHED_STOPPED
                bm.free(seq)
            if group.is_finished():
                resident.remove(group)
        elif op < 0.9:  # swap a request out
            group = rng.choice(resident)
            if bm.can_swap_out(group):
                mapping = bm.swap_out(group)
                copy(gpu, cpu, mapping.items())
                resident.remove(group)
                swapped.append(group)
        elif swapped:  # swap one back in
            group = rng.choice(swapped)
            if bm.can_swap_in(group, 0):
                copy(cpu, gpu, bm.swap_in(group).items())
                swapped.remove(group)
                resident.append(group)
        verify()
    for group in resident + swapped:
        for seq in group.seqs:
            bm.free(seq)
    assert bm.num_free_gpu_blocks == 24 and bm.num_free_cpu_blocks == 16
    check_invariants(bm)
