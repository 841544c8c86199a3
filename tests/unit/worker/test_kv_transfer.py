"""KV chunking, CRC32C and block reassembly."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvmesh.errors import DataLoss, FailedPrecondition
from kvmesh.mesh_keys import MeshKeys
from kvmesh.v1 import common_pb2
from services.worker.engine.api import KV_FORMAT_VERSION
from services.worker.kv_transfer import (
    MAX_CHUNK_BYTES,
    BlockAssembler,
    Pacer,
    check_compatible,
    chunk_block,
    crc32c,
)

HASH = b"h" * 16
KEYS = MeshKeys.from_secret("test stack")
LEASE = "lease-1"


def _chunks(
    index: int, data: bytes, max_chunk_bytes: int = MAX_CHUNK_BYTES, lease_id: str = LEASE
) -> list[common_pb2.KvChunk]:
    """The chunks an exporting worker of KEYS' stack sends for block `index` of LEASE."""
    digest = KEYS.block_digest(lease_id, index, HASH, data)
    return list(chunk_block(index, HASH, data, digest, max_chunk_bytes))


def test_crc32c_is_castagnoli() -> None:
    # The standard check value of CRC-32C (iSCSI polynomial).
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


def test_chunks_stay_under_the_limit_and_cover_the_block() -> None:
    data = bytes(range(256)) * (3 * MAX_CHUNK_BYTES // 256 + 7)
    chunks = _chunks(4, data)
    assert len(chunks) == 4
    assert all(len(c.data) <= MAX_CHUNK_BYTES for c in chunks)
    assert [c.offset for c in chunks] == [i * MAX_CHUNK_BYTES for i in range(4)]
    assert b"".join(c.data for c in chunks) == data
    assert all(c.crc32c == crc32c(c.data) and c.block_bytes == len(data) for c in chunks)
    assert {c.block_index for c in chunks} == {4}


def _assembler(block_bytes: int, *indices: int) -> BlockAssembler:
    return BlockAssembler({i: HASH for i in indices}, block_bytes, KEYS, LEASE)


def test_assembler_rebuilds_blocks_in_pieces() -> None:
    block = bytes(range(100))
    assembler = _assembler(100, 0, 1)
    pieces = _chunks(1, block, max_chunk_bytes=30)
    assert [assembler.add(p) for p in pieces[:-1]] == [None, None, None]
    assert assembler.add(pieces[-1]) == (1, block)
    assert assembler.missing() == [0]
    assert assembler.bytes_received == 100


def test_bad_checksum_is_data_loss() -> None:
    chunk = _chunks(0, b"x" * 64)[0]
    chunk.data = b"y" + chunk.data[1:]
    with pytest.raises(DataLoss, match="checksum"):
        _assembler(64, 0).add(chunk)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_index": 9}, "not asked for"),
        ({"block_hash": b"z" * 16}, "hash"),
        ({"block_bytes": 65}, "layout says"),
        ({"offset": 8}, "offset"),
    ],
)
def test_misplaced_pieces_are_data_loss(change: dict[str, object], message: str) -> None:
    chunk = _chunks(0, b"x" * 64, max_chunk_bytes=32)[0]
    for name, value in change.items():
        setattr(chunk, name, value)
    with pytest.raises(DataLoss, match=message):
        _assembler(64, 0).add(chunk)


def _forged(chunk: common_pb2.KvChunk, data: bytes) -> common_pb2.KvChunk:
    """`chunk` carrying other bytes with a matching CRC: only the keyed digest tells."""
    chunk.data = data
    chunk.crc32c = crc32c(data)
    return chunk


def _other_stack_chunk() -> common_pb2.KvChunk:
    data = b"x" * 64
    digest = MeshKeys.from_secret("another stack").block_digest(LEASE, 0, HASH, data)
    return next(chunk_block(0, HASH, data, digest))


@pytest.mark.parametrize(
    "forge",
    [
        lambda: _forged(_chunks(0, b"x" * 64)[0], b"y" * 64),  # other bytes, CRC fixed
        lambda: _chunks(0, b"x" * 64, lease_id="another lease")[0],  # another lease's block
        lambda: _chunks(1, b"x" * 64)[0],  # another index's digest, moved to index 0
        lambda: _other_stack_chunk(),  # the right fields, signed by another stack's key
    ],
    ids=["bytes", "lease", "index", "stack"],
)
def test_a_block_not_exported_for_this_lease_is_data_loss(
    forge: Callable[[], common_pb2.KvChunk],
) -> None:
    chunk = forge()
    chunk.block_index = 0
    with pytest.raises(DataLoss, match="digest"):
        _assembler(64, 0).add(chunk)


def test_a_block_in_pieces_is_checked_whole() -> None:
    pieces = _chunks(0, bytes(range(64)), max_chunk_bytes=32)
    pieces[1] = _forged(pieces[1], b"z" * 32)
    assembler = _assembler(64, 0)
    assert assembler.add(pieces[0]) is None
    with pytest.raises(DataLoss, match="digest"):
        assembler.add(pieces[1])
    assert assembler.missing() == [0]


def test_a_block_twice_is_data_loss() -> None:
    assembler = _assembler(8, 0)
    chunk = _chunks(0, b"x" * 8)[0]
    assembler.add(chunk)
    with pytest.raises(DataLoss, match="twice"):
        assembler.add(chunk)


def _layout(**overrides: object) -> common_pb2.KvLayout:
    fields: dict[str, object] = {
        "dtype": "float32",
        "block_size": 16,
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 16,
        "engine": "native",
        "format_version": KV_FORMAT_VERSION,
    }
    fields.update(overrides)
    return common_pb2.KvLayout(**fields)  # type: ignore[arg-type]


def test_compatibility_needs_same_fingerprint_and_layout() -> None:
    check_compatible("abc", _layout(), "abc", _layout())
    with pytest.raises(FailedPrecondition, match="fingerprint"):
        check_compatible("abc", _layout(), "abd", _layout())
    for change in ({"block_size": 8}, {"dtype": "bfloat16"}, {"engine": "vllm"}):
        with pytest.raises(FailedPrecondition, match="layout"):
            check_compatible("abc", _layout(), "abc", _layout(**change))


def test_blocks_of_another_format_version_are_refused() -> None:
    newer = _layout(format_version=KV_FORMAT_VERSION + 1)
    with pytest.raises(FailedPrecondition, match=f"format v{KV_FORMAT_VERSION + 1}"):
        check_compatible("abc", _layout(), "abc", newer)


async def test_pacer_holds_the_average_rate() -> None:
    now = [0.0]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    pacer = Pacer(1000.0, clock=lambda: now[0], sleep=sleep)
    await pacer.sent(500)  # 0.5 s worth at t=0
    await pacer.sent(500)  # 1.0 s worth, and 0.5 s already waited
    assert slept == pytest.approx([0.5, 0.5])
    now[0] += 5.0  # idle: the next send is under the cap already
    await pacer.sent(100)
    assert len(slept) == 2


async def test_unlimited_pacer_never_waits() -> None:
    async def sleep(seconds: float) -> None:
        raise AssertionError("must not sleep")

    await Pacer(0.0, sleep=sleep).sent(10**9)
