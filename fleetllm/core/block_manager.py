"""Paged KV-cache bookkeeping: which fixed-size blocks hold which sequence's tokens.

Two pools of reference-counted blocks: the device pool (where attention reads K/V) and a CPU
pool that preempted groups are swapped into. Each sequence has a block table, a list of block
ids; token position p lives in block `table[p // block_size]`, slot `p % block_size`.

Blocks are shared only through `fork` (n > 1 sampling: the children start with the parent's
prompt blocks). A shared block is never written in place: the first writer gets a private copy
(copy-on-write) and the caller tells the workers to copy the block's contents.

Allocation is lazy: a table grows only to cover the tokens computed this step, so a long prompt
split into chunks holds just the blocks its computed chunks need.
"""

from __future__ import annotations

from collections import deque

from fleetllm.errors import OutOfMemoryError
from fleetllm.sequence import Sequence, SequenceGroup


class _Pool:
    """Free list and reference counts of one pool of blocks."""

    def __init__(self, name: str, num_blocks: int):
        self.name = name
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))

    def allocate(self) -> int:
        if not self.free:
            # The scheduler checks can_* before every allocation; reaching this is a bug there.
            raise OutOfMemoryError(f"no free {self.name} KV-cache block left "
                                   f"({self.num_blocks} in all)")
        block = self.free.popleft()
        self.ref[block] = 1
        return block

    def incref(self, block: int) -> None:
        assert self.ref[block] > 0, f"{self.name} block {block} is free"
        self.ref[block] += 1

    def decref(self, block: int) -> None:
        assert self.ref[block] > 0, f"{self.name} block {block} freed twice"
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free.append(block)

    @property
    def usage(self) -> float:
        return 0.0 if self.num_blocks == 0 else 1 - len(self.free) / self.num_blocks


class BlockManager:
    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int):
        self.block_size = block_size
        self.gpu = _Pool("device", num_gpu_blocks)
        self.cpu = _Pool("cpu", num_cpu_blocks)
        self.block_tables: dict[int, list[int]] = {}  # seq_id -> device blocks
        self.cpu_tables: dict[int, list[int]] = {}  # seq_id -> cpu blocks, while swapped

    # ------------------------------------------------------------------ figures

    @property
    def num_gpu_blocks(self) -> int:
        return self.gpu.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu.num_blocks

    @property
    def num_free_gpu_blocks(self) -> int:
        return len(self.gpu.free)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.cpu.free)

    @property
    def gpu_usage(self) -> float:
        return self.gpu.usage

    @property
    def cpu_usage(self) -> float:
        return self.cpu.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables[seq.seq_id]

    # ------------------------------------------------------------------ growth

    def _required(self, seqs: list[Sequence], tables: dict[int, list[int]], ref: list[int],
                  num_new_tokens: int) -> int:
        """Device blocks needed so each seq can write `num_new_tokens` more tokens: new blocks
        past the table's end, plus a private copy of each shared block the writes land in.
        Exact across seqs sharing a block: the last holder writes in place, no copy."""
        bs = self.block_size
        need = 0
        copied: dict[int, int] = {}  # shared block -> copies already counted
        for seq in seqs:
            table = tables.get(seq.seq_id, [])
            start = seq.data.num_computed_tokens
            end = start + num_new_tokens
            need += max(0, self.num_blocks_for(end) - len(table))
            for block in table[start // bs: self.num_blocks_for(end)]:
                if ref[block] - copied.get(block, 0) > 1:
                    copied[block] = copied.get(block, 0) + 1
                    need += 1
        return need

    def num_required_blocks(self, seq_group: SequenceGroup, num_new_tokens: int) -> int:
        """Free device blocks the group's unfinished seqs need to compute `num_new_tokens`
        more tokens each (for a swapped group: including the blocks to swap back in)."""
        seqs = seq_group.unfinished_seqs()
        if any(s.seq_id in self.cpu_tables for s in seqs):
            return len(self._distinct(seqs, self.cpu_tables)) + \
                self._required(seqs, self.cpu_tables, self.cpu.ref, num_new_tokens)
        return self._required(seqs, self.block_tables, self.gpu.ref, num_new_tokens)

    def can_ensure(self, seq_group: SequenceGroup, num_new_tokens: int) -> bool:
        """Can every unfinished seq of the group get room for `num_new_tokens` more tokens?"""
        seqs = seq_group.unfinished_seqs()
        return self._required(seqs, self.block_tables, self.gpu.ref,
                              num_new_tokens) <= self.num_free_gpu_blocks

    def ensure_slots(self, seq: Sequence, num_tokens_total: int) -> list[tuple[int, int]]:
        """Grow seq's table to cover `num_tokens_total` tokens, the positions from
        num_computed_tokens on being written this step. Returns copy-on-write (src, dst)
        pairs: the workers must copy src into dst before the step runs."""
        bs = self.block_size
        table = self.block_tables.setdefault(seq.seq_id, [])
        cows = []
        first = seq.data.num_computed_tokens // bs
        for i in range(first, min(len(table), self.num_blocks_for(num_tokens_total))):
            old = table[i]
            if self.gpu.ref[old] > 1:  # shared with a fork: write into a private copy
                table[i] = self.gpu.allocate()
                self.gpu.decref(old)
                cows.append((old, table[i]))
        while len(table) < self.num_blocks_for(num_tokens_total):
            table.append(self.gpu.allocate())
        return cows

    def can_allocate(self, seq_group: SequenceGroup, num_new_tokens: int | None = None) -> bool:
        """Room for a waiting group's first chunk (None: all its uncomputed tokens)."""
        if num_new_tokens is None:
            num_new_tokens = seq_group.unfinished_seqs()[0].data.num_uncomputed_tokens()
        return self.can_ensure(seq_group, num_new_tokens)

    def allocate(self, seq_group: SequenceGroup, num_new_tokens: int | None = None) -> None:
        for seq in seq_group.unfinished_seqs():
            n = seq.data.num_uncomputed_tokens() if num_new_tokens is None else num_new_tokens
            cows = self.ensure_slots(seq, seq.data.num_computed_tokens + n)
            assert not cows, "a waiting sequence shares no blocks"

    def can_append_slots(self, seq_group: SequenceGroup, num_new_tokens: int = 1) -> bool:
        return self.can_ensure(seq_group, num_new_tokens)

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Room for a decode (or a prefill chunk) of `num_new_tokens`; returns CoW pairs."""
        return self.ensure_slots(seq, seq.data.num_computed_tokens + num_new_tokens)

    # ------------------------------------------------------------------ sharing, freeing

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        assert child_seq.seq_id not in self.block_tables, "child already has blocks"
        table = self.block_tables[parent_seq.seq_id]
        for block in table:
            self.gpu.incref(block)
        self.block_tables[child_seq.seq_id] = list(table)

    def free(self, seq: Sequence) -> None:
        for block in self.block_tables.pop(seq.seq_id, []):
            self.gpu.decref(block)
        for block in self.cpu_tables.pop(seq.seq_id, []):
            self.cpu.decref(block)

    # ------------------------------------------------------------------ swapping

    @staticmethod
    def _distinct(seqs: list[Sequence], tables: dict[int, list[int]]) -> set[int]:
        return {b for s in seqs for b in tables.get(s.seq_id, [])}

    def _resident(self, seq_group: SequenceGroup) -> list[Sequence]:
        return [s for s in seq_group.unfinished_seqs() if s.seq_id in self.block_tables]

    def _swapped(self, seq_group: SequenceGroup) -> list[Sequence]:
        return [s for s in seq_group.unfinished_seqs() if s.seq_id in self.cpu_tables]

    @staticmethod
    def _move(seqs: list[Sequence], src_tables: dict[int, list[int]], src: _Pool,
              dst_tables: dict[int, list[int]], dst: _Pool) -> dict[int, int]:
        """Move the seqs' tables from one pool to the other. A block shared by k of them
        maps to one block holding k references, so sharing survives the round trip."""
        mapping: dict[int, int] = {}
        for seq in seqs:
            new_table = []
            for block in src_tables.pop(seq.seq_id):
                if block in mapping:
                    dst.incref(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                new_table.append(mapping[block])
                src.decref(block)
            dst_tables[seq.seq_id] = new_table
        return mapping

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        blocks = self._distinct(self._resident(seq_group), self.block_tables)
        return len(blocks) <= self.num_free_cpu_blocks

    def swap_out(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Returns {device block: cpu block}; the device blocks are free after the copy."""
        return self._move(self._resident(seq_group), self.block_tables, self.gpu,
                          self.cpu_tables, self.cpu)

    def can_swap_in(self, seq_group: SequenceGroup, num_new_tokens: int = 1) -> bool:
        """Room to bring the group back and compute `num_new_tokens` more tokens per seq."""
        return self.num_required_blocks(seq_group, num_new_tokens) <= self.num_free_gpu_blocks

    def swap_in(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Returns {cpu block: device block}."""
        return self._move(self._swapped(seq_group), self.cpu_tables, self.cpu,
                          self.block_tables, self.gpu)
