import pytest

from services.worker.engine.block_pool import BlockKey, BlockPool


def key(*tokens: int, parent: bytes = b"", salt: bytes = b"") -> BlockKey:
    return BlockKey(parent, tokens, salt)


def test_allocate_hands_out_lowest_ids_first_and_none_when_short() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 3)
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1  # a failed allocation takes nothing
    assert pool.allocate(1) == [3]
    assert pool.allocate(0) == []


def test_freed_blocks_are_reused_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([2, 0])
    pool.free([3])
    assert pool.free_queue() == [2, 0, 3]
    assert pool.allocate(2) == [2, 0]
    assert pool.free_queue() == [3]


def test_a_freed_block_keeps_its_hash_until_reallocated() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2]
    assert pool.register(0, b"h0", key(1, 2))
    assert pool.register(1, b"h1", key(3, 4, parent=b"h0"))
    pool.free([1, 0, 2])  # queue: 1 (oldest), 0, 2
    assert pool.lookup(b"h0", key(1, 2)) == 0
    assert pool.lookup(b"h1", key(3, 4, parent=b"h0")) == 1
    assert pool.num_cached_blocks == 2

    assert pool.allocate(1) == [1]  # LRU: block 1 is evicted, its hash dropped
    assert pool.lookup(b"h1", key(3, 4, parent=b"h0")) is None
    assert pool.block_hash(1) is None
    assert pool.lookup(b"h0", key(1, 2)) == 0
    assert pool.cached_hashes() == [b"h0"]


def test_touching_a_free_cached_block_pins_it() -> None:
    pool = BlockPool(3)
    pool.allocate(3)
    pool.register(2, b"h2", key(7))
    pool.free([0, 1, 2])
    pool.touch([2])
    assert pool.ref_count(2) == 1
    assert pool.free_queue() == [0, 1]
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) is None  # block 2 is held, not evictable
    pool.touch([2])
    pool.free([2])
    assert pool.ref_count(2) == 1
    pool.free([2])
    assert pool.free_queue() == [2]
    assert pool.lookup(b"h2", key(7)) == 2


def test_lookup_verifies_content_not_just_hash() -> None:
    pool = BlockPool(1)
    pool.allocate(1)
    pool.register(0, b"same-hash", key(1, 2, salt=b"a"))
    assert pool.lookup(b"same-hash", key(1, 3, salt=b"a")) is None
    assert pool.lookup(b"same-hash", key(1, 2, salt=b"b")) is None
    assert pool.lookup(b"same-hash", key(1, 2, parent=b"x", salt=b"a")) is None
    assert pool.lookup(b"same-hash", key(1, 2, salt=b"a")) == 0


def test_second_block_with_same_hash_is_not_registered() -> None:
    pool = BlockPool(2)
    pool.allocate(2)
    assert pool.register(0, b"h", key(1))
    assert not pool.register(1, b"h", key(1))
    assert pool.block_hash(1) is None
    pool.free([1])
    assert pool.lookup(b"h", key(1)) == 0


def test_double_free_is_an_error() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    pool.free([0])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([0])


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)
