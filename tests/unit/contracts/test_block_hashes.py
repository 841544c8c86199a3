"""The block-hash chain: the documented byte format, and a golden vector that pins it."""

import hashlib
import struct

from kvmesh.contracts.block_hashes import hash_block, hash_block_chain

FP = "fingerprint-1"
BS = 4


def spec_hash(parent: bytes, tokens: list[int], fingerprint: str, salt: bytes) -> bytes:
    """The documented wire format, written out independently of the engine's code."""
    fp = fingerprint.encode()
    data = (
        len(parent).to_bytes(4, "little")
        + parent
        + len(fp).to_bytes(4, "little")
        + fp
        + len(salt).to_bytes(4, "little")
        + salt
        + b"".join(struct.pack("<I", t) for t in tokens)
    )
    return hashlib.blake2b(data, digest_size=16).digest()


def test_hash_block_matches_the_wire_format() -> None:
    h0 = hash_block(b"", [1, 2, 3, 4], FP, b"salt")
    assert h0 == spec_hash(b"", [1, 2, 3, 4], FP, b"salt")
    assert len(h0) == 16
    h1 = hash_block(h0, [5, 6], FP, b"salt")
    assert h1 == spec_hash(h0, [5, 6], FP, b"salt")
    assert hash_block_chain([1, 2, 3, 4, 5, 6], BS, FP, b"salt") == [h0, h1]


def test_hash_depends_on_parent_salt_fingerprint_and_tokens() -> None:
    base = hash_block(b"", [1, 2, 3, 4], FP, b"")
    variants = {
        hash_block(b"p" * 16, [1, 2, 3, 4], FP, b""),
        hash_block(b"", [1, 2, 3, 4], FP, b"tenant-a"),
        hash_block(b"", [1, 2, 3, 4], "other-model", b""),
        hash_block(b"", [1, 2, 3, 5], FP, b""),
        hash_block(b"", [1, 2, 3], FP, b""),
    }
    assert base not in variants
    assert len(variants) == 5


def test_golden_vector() -> None:
    """Every worker and router of every version must name these blocks with these bytes."""
    chain = hash_block_chain(list(range(10)), 4, "smollm2-135m@golden", b"tenant-a")
    assert [h.hex() for h in chain] == GOLDEN


GOLDEN = [
    "de6386d956d7a86240e13a019acfa3a4",
    "edf45381e289ae87f86687f9821c0b4c",
    "e84c29f866635ca72c1eac5de056eb45",
]
"""Tokens 0..9, block size 4, fingerprint "smollm2-135m@golden", salt b"tenant-a"."""
