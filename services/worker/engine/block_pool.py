"""A pool of fixed-size KV blocks: free queue, reference counts, and the prefix-cache index.

A block is free when nobody references it. A free block keeps its hash (and stays findable in
the prefix cache) until the pool hands it out again; the free queue is ordered so that the
least recently freed block is handed out, and evicted from the cache, first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class BlockKey:
    """What a cached block holds, compared on a hash hit so that a collision is never a hit."""

    parent_hash: bytes
    token_ids: tuple[int, ...]
    cache_salt: bytes


class BlockPool:
    """Block ids 0..num_blocks-1 with ref counts, an LRU free queue and a hash -> block map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._keys: list[BlockKey | None] = [None] * num_blocks
        # Insertion-ordered set of free block ids: popitem(last=False) takes the least recently
        # freed, and a cache hit removes a block from the middle, both in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references, cached ones included (they are evictable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[int] | None:
        """Take n free blocks (ref count 1, hash dropped), or None when fewer are free."""
        if n > len(self._free):
            return None
        block_ids = [self._free.popitem(last=False)[0] for _ in range(n)]
        for block_id in block_ids:
            self._evict(block_id)
            self._ref_counts[block_id] = 1
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (a prefix-cache hit); free ones leave the free queue."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop a reference to each block, in order; a block nobody holds joins the queue tail."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed more often than allocated")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def register(self, block_id: int, block_hash: bytes, key: BlockKey) -> bool:
        """Make a computed full block findable by its hash.

        Returns False (and leaves the block unregistered) when another block already holds
        the same content: the first one stays the cached copy.
        """
        if block_hash in self._cached:
            return self._cached[block_hash] == block_id
        self._cached[block_hash] = block_id
        self._hashes[block_id] = block_hash
        self._keys[block_id] = key
        return True

    def lookup(self, block_hash: bytes, key: BlockKey) -> int | None:
        """The cached block with this hash, if it really holds `key` (no ref count change)."""
        block_id = self._cached.get(block_hash)
        if block_id is None or self._keys[block_id] != key:
            return None
        return block_id

    def block_hash(self, block_id: int) -> bytes | None:
        return self._hashes[block_id]

    def cached_hashes(self) -> list[bytes]:
        return list(self._cached)

    def free_queue(self) -> list[int]:
        """Free block ids in eviction order (first is handed out next)."""
        return list(self._free)

    def _evict(self, block_id: int) -> None:
        block_hash = self._hashes[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hashes[block_id] = None
            self._keys[block_id] = None
