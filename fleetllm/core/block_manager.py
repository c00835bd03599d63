"""Paged KV-cache bookkeeping: which fixed-size blocks hold which sequence's tokens.

Two pools of reference-counted blocks: the device pool attention reads, and a CPU pool for
swapped-out groups. A sequence's block table lists block ids; position p lives in block
`table[p // block_size]`, slot `p % block_size`. Blocks are shared by `fork` (n > 1 samples)
and, with prefix caching, between prompts that start alike (prefix_cache.py); a shared block
is never written in place: the first writer gets a copy (copy-on-write) that the workers make.
Tables grow lazily, to the tokens computed this step. Every device block is exactly one of
free, evictable (cached, no owner; counted as free) or owned (ref > 0).
"""

from __future__ import annotations

from collections import deque

from fleetllm.core.prefix_cache import PrefixCache, block_hash
from fleetllm.errors import OutOfMemoryError
from fleetllm.sequence import Sequence, SequenceGroup


class _Pool:
    """Free list and reference counts of one pool of blocks."""

    def __init__(self, name: str, num_blocks: int, cache: PrefixCache | None = None):
        self.name = name
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.cache = cache  # the device pool's prefix cache, when enabled

    @property
    def num_free(self) -> int:
        return len(self.free) + (len(self.cache.evictable) if self.cache else 0)

    def allocate(self) -> int:
        if self.free:  # never-cached blocks first: evicting loses a prefix someone may reuse
            block = self.free.popleft()
        elif self.cache is not None and self.cache.evictable:
            block = self.cache.evict()
        else:
            # The scheduler checks can_* before every allocation; reaching this is a bug there.
            raise OutOfMemoryError(f"no free {self.name} KV-cache block left "
                                   f"({self.num_blocks} in all)")
        self.ref[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref[block] == 0 and self.cache is not None:  # a cache hit on a parked block
            assert block in self.cache.evictable, f"{self.name} block {block} is free"
            self.cache.revive(block)
        else:
            assert self.ref[block] > 0, f"{self.name} block {block} is free"
        self.ref[block] += 1

    def decref(self, block: int) -> None:
        assert self.ref[block] > 0, f"{self.name} block {block} freed twice"
        self.ref[block] -= 1
        if self.ref[block] == 0 and not (self.cache is not None and self.cache.released(block)):
            self.free.append(block)

    @property
    def usage(self) -> float:
        return 0.0 if self.num_blocks == 0 else 1 - self.num_free / self.num_blocks


class BlockManager:
    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.gpu = _Pool("device", num_gpu_blocks, self.prefix_cache)
        self.cpu = _Pool("cpu", num_cpu_blocks)
        self.block_tables: dict[int, list[int]] = {}  # seq_id -> device blocks
        self.cpu_tables: dict[int, list[int]] = {}  # seq_id -> cpu blocks, while swapped
        # Prefix caching, per sequence: content hashes of its full blocks so far, and how many
        # leading blocks of its current table were offered to the cache.
        self.seq_hashes: dict[int, list[bytes]] = {}
        self.registered: dict[int, int] = {}

    # ------------------------------------------------------------------ figures

    @property
    def num_gpu_blocks(self) -> int:
        return self.gpu.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu.num_blocks

    @property
    def num_free_gpu_blocks(self) -> int:
        """Free device blocks, counting cached blocks nobody owns (they are evicted on
        demand)."""
        return self.gpu.num_free

    @property
    def num_evictable_gpu_blocks(self) -> int:
        return len(self.prefix_cache.evictable) if self.prefix_cache else 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Of the prompt tokens of requests admitted with a cache lookup, the fraction found
        cached (0.0 without prefix caching)."""
        return self.prefix_cache.hit_rate if self.prefix_cache else 0.0

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
        if parent_seq.seq_id in self.seq_hashes:  # the same tokens so far
            self.seq_hashes[child_seq.seq_id] = list(self.seq_hashes[parent_seq.seq_id])
            self.registered[child_seq.seq_id] = self.registered.get(parent_seq.seq_id, 0)

    def free(self, seq: Sequence) -> None:
        # Last block first: parked cached blocks are evicted tail first, prefixes last.
        for block in reversed(self.block_tables.pop(seq.seq_id, [])):
            self.gpu.decref(block)
        for block in self.cpu_tables.pop(seq.seq_id, []):
            self.cpu.decref(block)
        self.seq_hashes.pop(seq.seq_id, None)
        self.registered.pop(seq.seq_id, None)

    # ------------------------------------------------------------------ prefix caching

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (parked blocks become free): call it whenever the
        device KV cache stops holding what was computed into it (new workers, new weights,
        another scheduler writing the same cache)."""
        cache = self.prefix_cache
        if cache is None:
            return
        self.gpu.free.extend(cache.evictable)
        cache.evictable.clear()
        cache.cached.clear()
        cache.hash_of.clear()
        for seq_id, table in self.block_tables.items():  # owned blocks: never registered again
            self.registered[seq_id] = len(table)

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The content hashes of the sequence's first num_blocks full blocks (memoized)."""
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        bs, data = self.block_size, seq.data
        while len(hashes) < num_blocks:
            i = len(hashes)
            n_prompt = len(data.prompt_token_ids)
            tokens = data.prompt_token_ids[i * bs:(i + 1) * bs] if (i + 1) * bs <= n_prompt \
                else data.all_token_ids[i * bs:(i + 1) * bs]
            # The first block's parent is the sequence's salt: its LoRA adapter, if any.
            hashes.append(block_hash(hashes[-1] if hashes else seq.cache_salt, tokens))
        return hashes

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The prefix-cache hashes of seq's first num_blocks full blocks (the KV connector
        names stored blocks by them)."""
        return list(self._hashes(seq, num_blocks))

    def prefix_hits(self, seq_group: SequenceGroup) -> list[int]:
        """Cached blocks holding the longest cached prefix of the group's sequences, in full
        blocks, leaving at least the last token to compute (its logits are needed). No side
        effects; [] without prefix caching or for a group that has started computing."""
        seqs = seq_group.unfinished_seqs()
        cache = self.prefix_cache
        if cache is None or any(s.data.num_computed_tokens or s.seq_id in self.block_tables
                                or s.seq_id in self.cpu_tables for s in seqs):
            return []
        # Sequences of one group share their prompt; beyond it they differ.
        limit = min((s.get_len() - 1) // self.block_size for s in seqs)
        if len(seqs) > 1:
            limit = min(limit, len(seqs[0].prompt_token_ids) // self.block_size)
        hits = []
        for digest in self._hashes(seqs[0], limit):
            block = cache.cached.get(digest)
            if block is None:
                break
            hits.append(block)
        return hits

    def take_prefix(self, seq_group: SequenceGroup, hits: list[int],
                    num_external_tokens: int = 0) -> None:
        """Admit the group with `hits` (from prefix_hits) as its sequences' first blocks,
        then new blocks for `num_external_tokens` (whole blocks a KV connector loads before
        the step runs): all count as computed. The loaded blocks become findable only once a
        step has completed (mark_computed), never if their load fails."""
        cache = self.prefix_cache
        external = self.num_blocks_for(num_external_tokens)
        for seq in seq_group.unfinished_seqs():
            for block in hits:
                self.gpu.incref(block)  # revives a parked block
            self.block_tables[seq.seq_id] = list(hits) + \
                [self.gpu.allocate() for _ in range(external)]
            self.registered[seq.seq_id] = len(hits)
            seq.data.num_computed_tokens = len(hits) * self.block_size + num_external_tokens
            if cache is not None:
                cache.queried_tokens += seq.get_len()
                cache.hit_tokens += len(hits) * self.block_size

    def can_take_prefix(self, seq_group: SequenceGroup, hits: list[int],
                        num_new_tokens: int, num_external_tokens: int = 0) -> bool:
        """Room to admit the group with `hits` (and `num_external_tokens` to load) and compute
        num_new_tokens more per sequence: new blocks past the hits, plus the parked hits
        (they stop counting as free)."""
        seqs = seq_group.unfinished_seqs()
        past = self.num_blocks_for(len(hits) * self.block_size + num_external_tokens
                                   + num_new_tokens) - len(hits)
        parked = sum(1 for b in hits if self.gpu.ref[b] == 0)
        return len(seqs) * past + parked <= self.num_free_gpu_blocks

    def mark_computed(self, seq: Sequence) -> None:
        """The sequence's K/V is computed up to num_computed_tokens: its newly full blocks
        become findable. Amortized O(1) per token (each block is hashed once)."""
        if self.prefix_cache is None or seq.seq_id not in self.block_tables:
            return
        table = self.block_tables[seq.seq_id]
        full = min(seq.data.num_computed_tokens // self.block_size, len(table))
        start = self.registered.get(seq.seq_id, 0)
        if full <= start:
            return
        hashes = self._hashes(seq, full)
        for i in range(start, full):
            self.prefix_cache.register(table[i], hashes[i])
        self.registered[seq.seq_id] = full

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
        """Returns {cpu block: device block}. The new device blocks are offered to the
        prefix cache once a step has run (their contents arrive with that step)."""
        seqs = self._swapped(seq_group)
        for seq in seqs:
            self.registered.pop(seq.seq_id, None)
        return self._move(seqs, self.cpu_tables, self.cpu, self.block_tables, self.gpu)
