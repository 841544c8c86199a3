"""The block-hash chain: how every worker and the router name a block of KV.

A prompt's tokens are cut into blocks of `block_size`; block i's hash is

    blake2b(digest_size=16) over, in order:
        len(parent) as uint32 little-endian, parent        (parent: block i-1's hash; b"" for i=0)
        len(fingerprint) as uint32 LE, fingerprint as UTF-8  (the model's fingerprint)
        len(cache_salt) as uint32 LE, cache_salt             (the tenant's isolation salt)
        every token id of the block as uint32 LE

so equal hashes mean equal tokens, model, salt and everything before the block. The last block
of a sequence may be partial. `KvLease.block_hashes` and `WorkerStats.cached_block_hashes` carry
these hashes; the golden vector in tests/unit/contracts/test_block_hashes.py pins the bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_PARENT_HASH = b""
"""Parent hash of the first block of every sequence."""
BLOCK_HASH_BYTES = 16


def hash_block(
    parent_hash: bytes, token_ids: Sequence[int], fingerprint: str, cache_salt: bytes = b""
) -> bytes:
    """Chained hash of one block: 16 bytes of blake2b over parent, model, salt and tokens.

    Each variable-length part is length-prefixed so no two different inputs share an
    encoding; token ids are little-endian uint32, so the hash is the same on every machine
    (the worker sends these hashes on the wire to name blocks).
    """
    digest = hashlib.blake2b(digest_size=BLOCK_HASH_BYTES)
    for part in (parent_hash, fingerprint.encode(), cache_salt):
        digest.update(len(part).to_bytes(4, "little"))
        digest.update(part)
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return digest.digest()


def hash_block_chain(
    token_ids: Sequence[int], block_size: int, fingerprint: str, cache_salt: bytes = b""
) -> list[bytes]:
    """Hashes of every block of token_ids, the last one over a partial block if any."""
    hashes: list[bytes] = []
    parent = ROOT_PARENT_HASH
    for start in range(0, len(token_ids), block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], fingerprint, cache_salt)
        hashes.append(parent)
    return hashes
