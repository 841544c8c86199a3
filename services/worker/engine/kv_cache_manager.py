"""Who holds which KV blocks: per-request block tables, prefix-cache lookups, holds, imports.

Every block the engine holds is owned here by exactly one of: a request's block table, a held
prefill (a KvHandle) or an import in progress (a block table under the request id), so that
freeing a request, a handle or an import always returns every block it took.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.contracts.block_hashes import ROOT_PARENT_HASH, hash_block
from services.worker.engine.api import KvCapacityError
from services.worker.engine.block_pool import BlockKey, BlockPool
from services.worker.engine.request import RequestState


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KvCacheManager:
    """Block tables and the prefix cache over one BlockPool."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        fingerprint: str,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[int]] = {}
        # How many leading blocks of each table are registered in the prefix cache.
        self._num_registered: dict[str, int] = {}
        self._held: dict[str, list[int]] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- block tables -------------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def find_cached_prefix(self, state: RequestState) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens (refs unchanged).

        Never the whole sequence: at least one token is left to compute, for its logits.
        """
        if not self.enable_prefix_caching:
            return []
        return self._lookup_chain(state, (state.num_tokens - 1) // self.block_size)

    def admit(self, state: RequestState, cached_blocks: list[int], num_new_tokens: int) -> bool:
        """Give a request with no blocks the cached blocks plus room for num_new_tokens more.

        Returns False, changing nothing, when the pool can't take it. Counts the lookup.
        """
        if state.request_id in self._tables:
            raise ValueError(f"request {state.request_id!r} already holds blocks")
        num_cached_tokens = len(cached_blocks) * self.block_size
        if not self._grow(state.request_id, [], cached_blocks, num_cached_tokens + num_new_tokens):
            return False
        self._num_registered[state.request_id] = len(cached_blocks)
        self.prefix_query_tokens += state.num_tokens
        self.prefix_hit_tokens += num_cached_tokens
        return True

    def allocate_slots(self, state: RequestState, num_new_tokens: int) -> bool:
        """Room for num_new_tokens after the computed ones; False (nothing changed) if full."""
        table = self._tables[state.request_id]
        return self._grow(state.request_id, table, [], state.num_computed_tokens + num_new_tokens)

    def cache_computed_blocks(self, state: RequestState) -> None:
        """Register the request's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = state.num_computed_tokens // self.block_size
        first = self._num_registered[state.request_id]
        if num_full <= first:
            return
        hashes = self.full_block_hashes(state, num_full)
        table = self._tables[state.request_id]
        for index in range(first, num_full):
            key = self._block_key(state, index, hashes)
            self.pool.register(table[index], hashes[index], key)
        self._num_registered[state.request_id] = num_full

    def free(self, request_id: str) -> int:
        """Release a request's blocks (tail first, so its tail is evicted first)."""
        table = self._tables.pop(request_id, [])
        self._num_registered.pop(request_id, None)
        self.pool.free(reversed(table))
        return len(table)

    # ---- hashes -------------------------------------------------------------------------

    def full_block_hashes(self, state: RequestState, num_blocks: int) -> list[bytes]:
        """The first num_blocks chained hashes of the request's full blocks (memoised)."""
        hashes = state.block_hashes
        tokens = state.token_ids
        size = self.block_size
        salt = state.request.cache_salt
        while len(hashes) < num_blocks:
            index = len(hashes)
            parent = hashes[-1] if hashes else ROOT_PARENT_HASH
            block_tokens = tokens[index * size : (index + 1) * size]
            hashes.append(hash_block(parent, block_tokens, self.fingerprint, salt))
        return hashes[:num_blocks]

    def sequence_hashes(self, state: RequestState, num_tokens: int) -> list[bytes]:
        """Hashes of the blocks covering num_tokens tokens; the last may cover a partial block."""
        num_full, rest = divmod(num_tokens, self.block_size)
        hashes = self.full_block_hashes(state, num_full)
        if rest:
            parent = hashes[-1] if hashes else ROOT_PARENT_HASH
            start = num_full * self.block_size
            partial = state.token_ids[start:num_tokens]
            hashes.append(hash_block(parent, partial, self.fingerprint, state.request.cache_salt))
        return hashes

    # ---- holds (prefill role) -----------------------------------------------------------

    def hold(self, request_id: str, handle_id: str) -> list[int]:
        """Move a request's blocks under a handle, still pinned."""
        if handle_id in self._held:
            raise ValueError(f"handle {handle_id!r} already exists")
        blocks = self._tables.pop(request_id)
        self._num_registered.pop(request_id, None)
        self._held[handle_id] = blocks
        return blocks

    def held_blocks(self, handle_id: str) -> list[int]:
        """Blocks of a handle; KeyError when unknown or released."""
        return self._held[handle_id]

    def release(self, handle_id: str) -> int:
        """Unpin a handle's blocks (they stay cached, evictable); KeyError when unknown."""
        blocks = self._held.pop(handle_id)
        self.pool.free(reversed(blocks))
        return len(blocks)

    @property
    def num_held(self) -> int:
        return len(self._held)

    # ---- imports (decode role) ----------------------------------------------------------

    def start_import(
        self, state: RequestState, block_hashes: Sequence[bytes], num_tokens: int
    ) -> tuple[list[int], list[int]]:
        """Allocate every block of an incoming lease; reuse leading blocks cached here.

        Returns (block ids, indices of the blocks to pull). The lease's hashes must equal the
        ones computed here from the request's own tokens, salt and model fingerprint.
        Raises KvCapacityError when the pool cannot take the blocks.
        """
        if not 0 < num_tokens <= state.num_tokens:
            raise ValueError(f"num_tokens must be in [1, {state.num_tokens}], got {num_tokens}")
        expected = self.sequence_hashes(state, num_tokens)
        if len(block_hashes) != len(expected):
            raise ValueError(
                f"a lease of {num_tokens} tokens has {len(expected)} blocks, "
                f"got {len(block_hashes)} hashes"
            )
        for index, (theirs, ours) in enumerate(zip(block_hashes, expected, strict=True)):
            if theirs != ours:
                raise ValueError(
                    f"block {index}: lease hash differs from this engine's "
                    "(other tokens, cache salt or model fingerprint)"
                )
        cached = (
            self._lookup_chain(state, num_tokens // self.block_size)
            if self.enable_prefix_caching
            else []
        )
        if not self.admit(state, cached, num_tokens - len(cached) * self.block_size):
            raise KvCapacityError(
                f"no room for {len(expected) - len(cached)} KV blocks "
                f"({self.pool.num_free_blocks} free)"
            )
        return list(self._tables[state.request_id]), list(range(len(cached), len(expected)))

    # ---- internals ----------------------------------------------------------------------

    def _grow(
        self, request_id: str, table: list[int], cached_blocks: list[int], num_tokens: int
    ) -> bool:
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(table) - len(cached_blocks)
        num_revived = sum(1 for b in cached_blocks if self.pool.ref_count(b) == 0)
        if max(num_new_blocks, 0) + num_revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(cached_blocks)
        new_blocks = self.pool.allocate(max(num_new_blocks, 0))
        assert new_blocks is not None  # checked above
        table.extend(cached_blocks)
        table.extend(new_blocks)
        self._tables[request_id] = table
        return True

    def _lookup_chain(self, state: RequestState, max_blocks: int) -> list[int]:
        hashes = self.full_block_hashes(state, max_blocks)
        hits: list[int] = []
        for index, block_hash in enumerate(hashes):
            block_id = self.pool.lookup(block_hash, self._block_key(state, index, hashes))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _block_key(self, state: RequestState, index: int, hashes: list[bytes]) -> BlockKey:
        size = self.block_size
        return BlockKey(
            parent_hash=hashes[index - 1] if index else ROOT_PARENT_HASH,
            token_ids=tuple(state.token_ids[index * size : (index + 1) * size]),
            cache_salt=state.request.cache_salt,
        )
