"""KV blocks on the wire: checksummed chunks out of a prefill worker, verified blocks into a decode.

A block's bytes are cut into KvChunk messages of at most `MAX_CHUNK_BYTES` (under the gRPC
message limit), each carrying the CRC32C (Castagnoli) of its data and the keyed digest that
binds the whole block to its lease (mesh_keys.py). The decode side reassembles each block from
its pieces, in order, and refuses anything that does not add up: a wrong checksum, a piece out
of place, a block that is not the one expected, a block whose digest does not verify. Refusals
raise DataLoss so the caller can drop the half-imported request before anything is committed.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field

import google_crc32c

from kvmesh.errors import DataLoss, FailedPrecondition
from kvmesh.mesh_keys import MeshKeys
from kvmesh.v1 import common_pb2

MAX_CHUNK_BYTES = 1 << 20
"""Largest data piece of one KvChunk: 1 MiB, well under the 8 MiB gRPC message limit."""


def crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli) of `data`, as on the wire (google-crc32c, C implementation)."""
    return int(google_crc32c.value(data))


def chunk_block(
    block_index: int,
    block_hash: bytes,
    data: bytes,
    digest: bytes,
    max_chunk_bytes: int = MAX_CHUNK_BYTES,
) -> Iterator[common_pb2.KvChunk]:
    """The chunks of one block, in offset order, each at most `max_chunk_bytes` of data and
    each carrying the block's keyed `digest`."""
    if max_chunk_bytes <= 0:
        raise ValueError("max_chunk_bytes must be positive")
    for offset, piece in _pieces(data, max_chunk_bytes):
        yield common_pb2.KvChunk(
            block_index=block_index,
            block_hash=block_hash,
            offset=offset,
            block_bytes=len(data),
            data=piece,
            crc32c=crc32c(piece),
            block_digest=digest,
        )


def _pieces(data: bytes, max_bytes: int) -> Iterator[tuple[int, bytes]]:
    if len(data) <= max_bytes:
        yield 0, data  # the usual case, a block in one chunk: no copy of its bytes
        return
    view = memoryview(data)
    for offset in range(0, len(data), max_bytes):
        yield offset, bytes(view[offset : offset + max_bytes])


def layouts_equal(a: common_pb2.KvLayout, b: common_pb2.KvLayout) -> bool:
    """Two engines can exchange blocks only when every layout field agrees."""
    return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


def check_compatible(
    own_fingerprint: str,
    own_layout: common_pb2.KvLayout,
    their_fingerprint: str,
    their_layout: common_pb2.KvLayout,
) -> None:
    """FailedPrecondition unless both sides run the same weights with the same block layout."""
    if own_fingerprint != their_fingerprint:
        raise FailedPrecondition(
            f"model fingerprint mismatch: this worker runs {own_fingerprint!r}, "
            f"the lease was computed by {their_fingerprint!r}"
        )
    if not layouts_equal(own_layout, their_layout):
        raise FailedPrecondition(
            f"KV layout mismatch: this worker uses {_describe(own_layout)}, "
            f"the lease uses {_describe(their_layout)}"
        )


def _describe(layout: common_pb2.KvLayout) -> str:
    return (
        f"{layout.engine}/{layout.dtype} block_size={layout.block_size} "
        f"layers={layout.num_layers} kv_heads={layout.num_kv_heads} head_dim={layout.head_dim} "
        f"format v{layout.format_version}"
    )


@dataclass(slots=True)
class _PartialBlock:
    block_hash: bytes
    data: bytearray = field(default_factory=bytearray)


@dataclass(slots=True)
class BlockAssembler:
    """Rebuilds the expected blocks from a stream of chunks, verifying every piece.

    `expected` maps each block index to pull onto its hash; `block_bytes` is the size every
    block must have under the puller's layout; `keys` and `lease_id` check each block's digest.
    """

    expected: Mapping[int, bytes]
    block_bytes: int
    keys: MeshKeys
    lease_id: str
    _partial: dict[int, _PartialBlock] = field(default_factory=dict)
    _done: set[int] = field(default_factory=set)
    bytes_received: int = 0

    def add(self, chunk: common_pb2.KvChunk) -> tuple[int, bytes] | None:
        """Takes one chunk; returns (index, block bytes) when it completes a block."""
        # Read once: every read of a bytes field copies it out of the message.
        data = chunk.data
        index = chunk.block_index
        if index not in self.expected:
            raise DataLoss(f"KV chunk for block {index}, which was not asked for")
        if index in self._done:
            raise DataLoss(f"KV block {index} arrived twice")
        if chunk.block_hash != self.expected[index]:
            raise DataLoss(
                f"KV block {index} has hash {chunk.block_hash.hex()[:16]}…, expected "
                f"{self.expected[index].hex()[:16]}…"
            )
        if chunk.block_bytes != self.block_bytes:
            raise DataLoss(
                f"KV block {index} is {chunk.block_bytes} bytes, the layout says {self.block_bytes}"
            )
        if crc32c(data) != chunk.crc32c:
            raise DataLoss(f"KV block {index}: checksum mismatch at offset {chunk.offset}")
        partial = self._partial.get(index)
        received = 0 if partial is None else len(partial.data)
        if chunk.offset != received:
            raise DataLoss(f"KV block {index}: piece at offset {chunk.offset}, expected {received}")
        if received + len(data) > self.block_bytes:
            raise DataLoss(f"KV block {index}: more bytes than the block holds")
        self.bytes_received += len(data)
        if partial is None and len(data) == self.block_bytes:
            # The whole block in one chunk (the usual case): no reassembly copies.
            return self._complete(index, data, chunk.block_digest)
        if partial is None:
            partial = self._partial[index] = _PartialBlock(chunk.block_hash)
        partial.data += data
        if len(partial.data) < self.block_bytes:
            return None
        del self._partial[index]
        return self._complete(index, bytes(partial.data), chunk.block_digest)

    def _complete(self, index: int, data: bytes, digest: bytes) -> tuple[int, bytes]:
        """The finished block, once its digest shows it was exported for this lease."""
        expected = self.keys.block_digest(self.lease_id, index, self.expected[index], data)
        if not hmac.compare_digest(expected, digest):
            raise DataLoss(f"KV block {index}: its digest does not bind it to this lease")
        self._done.add(index)
        return index, data

    def missing(self) -> list[int]:
        """Indices of the expected blocks not yet complete, in order."""
        return sorted(set(self.expected) - self._done)


@dataclass(slots=True)
class Pacer:
    """Holds a sender to at most `bytes_per_s` on average (0: unlimited).

    A worker sharing its network with client traffic caps the rate of KV it sends, and the
    same cap emulates a slower link on one machine (benchmarks, failure tests).
    """

    bytes_per_s: float
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    _started: float | None = None
    _sent: int = 0

    async def sent(self, num_bytes: int) -> None:
        """Records `num_bytes` sent; waits until the average rate is back under the cap."""
        if self.bytes_per_s <= 0:
            return
        now = self.clock()
        if self._started is None:
            self._started = now
        self._sent += num_bytes
        ahead = self._started + self._sent / self.bytes_per_s - now
        if ahead > 0:
            await self.sleep(ahead)
