"""Automatic prefix caching: device blocks found again by the tokens they hold.

A full block whose K/V is computed gets a content hash: a 128-bit BLAKE2b of its parent's
hash and its tokens, so equal hashes mean equal prefixes (a keyed chain: no request can craft
a collision and read another's K/V). `cached` maps each hash to one block. A new request takes
the blocks of its longest cached prefix of full blocks instead of computing them.

A cached block whose last owner is gone is not freed but parked in `evictable` (LRU order):
it still counts as free, and allocation evicts the least recently released one (dropping its
hash) only when no never-cached block is left. Owners release their blocks last-first, so a
sequence's tail is evicted before its prefix, which other requests are likelier to share.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class PrefixCache:
    """The hash <-> block maps of one device pool, its evictable blocks and hit counters."""

    def __init__(self) -> None:
        self.cached: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}  # block -> its hash, while cached
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU
        self.queried_tokens = 0  # prompt tokens of the requests admitted with a lookup
        self.hit_tokens = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def register(self, block: int, digest: bytes) -> None:
        """A full, computed block: findable from now on (unless its content is already)."""
        if digest not in self.cached and block not in self.hash_of:
            self.cached[digest] = block
            self.hash_of[block] = digest

    def released(self, block: int) -> bool:
        """The block's last owner let it go: park it if cached (True), else it is free."""
        if block in self.hash_of:
            self.evictable[block] = None
            return True
        return False

    def revive(self, block: int) -> None:
        """A hit on a block nobody owned: it leaves the evictable set."""
        self.evictable.pop(block, None)

    def evict(self) -> int:
        """The least recently released cached block, forgotten and handed out."""
        block, _ = self.evictable.popitem(last=False)
        del self.cached[self.hash_of.pop(block)]
        return block
