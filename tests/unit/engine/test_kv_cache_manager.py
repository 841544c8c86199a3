import pytest

from kvmesh.contracts.block_hashes import hash_block, hash_block_chain
from services.worker.engine.api import KvCapacityError
from services.worker.engine.block_pool import BlockPool
from services.worker.engine.kv_cache_manager import KvCacheManager
from services.worker.engine.request import RequestState
from tests.unit.engine.factories import make_state

FP = "fingerprint-1"
BS = 4


def computed(kv: KvCacheManager, state: RequestState, num_tokens: int) -> None:
    """Pretend the model computed the request's first num_tokens tokens."""
    state.num_computed_tokens = num_tokens
    kv.cache_computed_blocks(state)


def admit(kv: KvCacheManager, state: RequestState) -> list[int]:
    cached = kv.find_cached_prefix(state)
    assert kv.admit(state, cached, state.num_tokens - len(cached) * BS)
    state.num_computed_tokens = len(cached) * BS
    return cached


def manager(num_blocks: int = 8) -> KvCacheManager:
    return KvCacheManager(BlockPool(num_blocks), BS, FP)


def test_full_blocks_are_registered_after_compute_and_found_by_the_next_request() -> None:
    kv = manager()
    a = make_state("a", list(range(10)))  # blocks: [0..3] [4..7] [8, 9]
    assert admit(kv, a) == []
    assert kv.block_table("a") == [0, 1, 2]
    computed(kv, a, 10)
    h = hash_block_chain(list(range(10)), BS, FP)
    assert kv.pool.cached_hashes() == h[:2]  # the partial block is not cached
    assert kv.full_block_hashes(a, 2) == h[:2]

    b = make_state("b", [*range(8), 99, 98, 97])
    assert admit(kv, b) == [0, 1]
    assert kv.block_table("b") == [0, 1, 3]
    assert (kv.pool.ref_count(0), kv.pool.ref_count(1)) == (2, 2)
    assert (kv.prefix_query_tokens, kv.prefix_hit_tokens) == (10 + 11, 8)


def test_lookup_never_covers_the_whole_sequence() -> None:
    kv = manager()
    a = make_state("a", list(range(8)))
    admit(kv, a)
    computed(kv, a, 8)
    kv.free("a")
    again = make_state("again", list(range(8)))
    # Both blocks are cached, but the last token must be computed to get logits.
    assert admit(kv, again) == [0]
    assert again.num_computed_tokens == 4


def test_free_releases_tail_first_so_tail_blocks_are_evicted_first() -> None:
    kv = manager(num_blocks=4)
    a = make_state("a", list(range(12)))
    admit(kv, a)
    computed(kv, a, 12)
    assert kv.free("a") == 3
    assert kv.pool.free_queue() == [3, 2, 1, 0]
    other = make_state("other", [50, 51, 52, 53, 54])
    admit(kv, other)  # needs 2 blocks: block 3 (never used) and block 2 (a's tail)
    assert kv.block_table("other") == [3, 2]
    again = make_state("again", list(range(12)))
    assert kv.find_cached_prefix(again) == [0, 1]


def test_different_salts_never_share_blocks() -> None:
    kv = manager()
    a = make_state("a", list(range(9)), cache_salt=b"tenant-a")
    admit(kv, a)
    computed(kv, a, 9)
    b = make_state("b", list(range(9)), cache_salt=b"tenant-b")
    assert admit(kv, b) == []
    assert set(kv.block_table("a")).isdisjoint(kv.block_table("b"))
    c = make_state("c", list(range(9)), cache_salt=b"tenant-a")
    assert admit(kv, c) == kv.block_table("a")[:2]


def test_prefix_caching_off_finds_nothing() -> None:
    kv = KvCacheManager(BlockPool(8), BS, FP, enable_prefix_caching=False)
    a = make_state("a", list(range(9)))
    admit(kv, a)
    computed(kv, a, 9)
    assert kv.pool.cached_hashes() == []
    assert kv.find_cached_prefix(make_state("b", list(range(9)))) == []


def test_allocate_slots_grows_the_table_and_fails_without_side_effects() -> None:
    kv = manager(num_blocks=3)
    a = make_state("a", [1, 2, 3])
    admit(kv, a)
    computed(kv, a, 3)
    a.token_ids.append(4)
    assert kv.allocate_slots(a, 1)  # position 3 still fits in block 0
    assert kv.block_table("a") == [0]
    computed(kv, a, 4)
    a.token_ids.append(5)
    assert kv.allocate_slots(a, 1)
    assert kv.block_table("a") == [0, 1]
    assert not kv.allocate_slots(a, 9)  # would need 2 more blocks, 1 is free
    assert kv.block_table("a") == [0, 1]
    assert kv.pool.num_free_blocks == 1


def test_hold_pins_blocks_until_release() -> None:
    kv = manager(num_blocks=4)
    a = make_state("a", list(range(6)))
    admit(kv, a)
    computed(kv, a, 6)
    assert kv.hold("a", "handle-1") == [0, 1]
    assert not kv.has_blocks("a")
    assert kv.held_blocks("handle-1") == [0, 1]
    assert kv.pool.num_free_blocks == 2
    assert kv.release("handle-1") == 2
    assert kv.pool.free_queue() == [2, 3, 1, 0]
    with pytest.raises(KeyError):
        kv.release("handle-1")


def test_sequence_hashes_end_with_the_partial_block() -> None:
    kv = manager()
    a = make_state("a", list(range(10)))
    hashes = kv.sequence_hashes(a, 10)
    assert hashes == hash_block_chain(list(range(10)), BS, FP)
    assert hashes[2] == hash_block(hashes[1], [8, 9], FP)
    assert kv.sequence_hashes(a, 8) == hashes[:2]


def test_import_reuses_cached_leading_blocks_and_pulls_the_rest() -> None:
    prompt = list(range(14))  # 3 full blocks + 2 tokens
    lease_hashes = hash_block_chain(prompt, BS, FP)
    kv = manager(num_blocks=8)
    local = make_state("local", [*prompt[:8], 77])  # shares 2 blocks with the lease
    admit(kv, local)
    computed(kv, local, 9)
    kv.free("local")

    incoming = make_state("incoming", prompt)
    block_ids, missing = kv.start_import(incoming, lease_hashes, len(prompt))
    # 0 and 1 are reused; the free queue is [3, 4, 5, 6, 7, 2] (never-used blocks, then
    # local's freed tail), so the two new blocks are 3 and 4.
    assert block_ids == [0, 1, 3, 4]
    assert missing == [2, 3]
    incoming.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(incoming)
    assert kv.find_cached_prefix(make_state("next", prompt)) == [0, 1, 3]
    assert lease_hashes[3] not in kv.pool.cached_hashes()


def test_import_rejects_hashes_from_other_tokens_or_salt() -> None:
    kv = manager()
    prompt = list(range(6))
    incoming = make_state("incoming", prompt, cache_salt=b"x")
    with pytest.raises(ValueError, match="block 0"):
        kv.start_import(incoming, hash_block_chain(prompt, BS, FP), 6)
    with pytest.raises(ValueError, match="2 blocks"):
        kv.start_import(incoming, hash_block_chain(prompt, BS, FP, b"x")[:1], 6)
    assert kv.pool.num_free_blocks == 8


def test_import_that_does_not_fit_raises_and_takes_nothing() -> None:
    kv = manager(num_blocks=2)
    prompt = list(range(9))
    incoming = make_state("incoming", prompt)
    with pytest.raises(KvCapacityError):
        kv.start_import(incoming, hash_block_chain(prompt, BS, FP), 9)
    assert kv.pool.num_free_blocks == 2
    assert not kv.has_blocks("incoming")
