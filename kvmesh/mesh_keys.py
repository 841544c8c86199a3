"""The keys a stack's secret gives its members, and what each of them signs.

Every member of one stack is started with the same mesh secret (`kvmesh up` and compose
generate it). From it come three keys, one per use, so a value signed for one use never
passes for another:

- the lease key: a prefill worker signs each KvLease it grants; a decode worker dials a
  lease's worker address only when the signature verifies, so it never dials an address a
  caller wrote;
- the KV key: the exporting worker binds every block's bytes to its lease (lease id, block
  index, block hash, bytes) with a keyed digest the importing worker checks before the block
  is written, so bytes that were not exported for that lease never reach a prefix cache;
- the member key: without TLS, a call carries its caller's role and name with a token made
  with this key (see mesh_auth.py).

Without a secret every key is derived from the empty secret: the checks still run (a lease
altered in flight still fails), but anyone can sign, so such a stack trusts its network.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from kvmesh.v1 import common_pb2

DIGEST = hashlib.sha256


def _derive(secret: bytes, use: str) -> bytes:
    return hmac.new(secret, f"kvmesh/{use}".encode(), DIGEST).digest()


@dataclass(slots=True, frozen=True)
class MeshKeys:
    """One stack's keys, each derived from its mesh secret."""

    lease: bytes
    """Signs KV leases."""
    kv: bytes
    """Binds exported KV bytes to their lease."""
    member: bytes
    """Makes the per-call member tokens of a stack without TLS."""
    secret_set: bool
    """A mesh secret was configured (without one, anyone can sign)."""

    @classmethod
    def from_file(cls, path: Path | None) -> MeshKeys:
        """The keys of the stack whose secret is in `path` (None: no secret)."""
        if path is None:
            return cls.from_secret("")
        secret = path.read_text(encoding="utf-8").strip()
        if not secret:
            raise ValueError(f"mesh secret file {path} is empty")
        return cls.from_secret(secret)

    @classmethod
    def from_secret(cls, secret: str) -> MeshKeys:
        """The keys of the stack whose secret is `secret` (may be empty)."""
        raw = secret.encode()
        return cls(
            lease=_derive(raw, "lease"),
            kv=_derive(raw, "kv"),
            member=_derive(raw, "member"),
            secret_set=bool(secret),
        )

    def sign_lease(self, lease: common_pb2.KvLease) -> bytes:
        """The signature over every field of `lease` but its signature."""
        unsigned = common_pb2.KvLease()
        unsigned.CopyFrom(lease)
        unsigned.ClearField("signature")
        return hmac.new(self.lease, unsigned.SerializeToString(deterministic=True), DIGEST).digest()

    def lease_is_signed(self, lease: common_pb2.KvLease) -> bool:
        """Whether `lease` carries this stack's signature (in constant time)."""
        return hmac.compare_digest(self.sign_lease(lease), lease.signature)

    def block_digest(
        self, lease_id: str, block_index: int, block_hash: bytes, data: bytes | memoryview
    ) -> bytes:
        """The keyed digest binding one block's bytes to its place in a lease."""
        mac = hmac.new(self.kv, digestmod=DIGEST)
        # Lengths first, so no two different (lease id, hash) pairs share a byte string.
        ids = lease_id.encode()
        mac.update(struct.pack("<QQQ", len(ids), block_index, len(block_hash)))
        mac.update(ids)
        mac.update(block_hash)
        mac.update(data)
        return mac.digest()

    def member_token(self, role: str, name: str) -> str:
        """The token a member of `role` named `name` sends with its calls (no TLS)."""
        message = f"{role}\n{name}".encode()
        return hmac.new(self.member, message, DIGEST).hexdigest()


def write_secret_file(path: Path) -> Path:
    """Writes a new random mesh secret to `path`, readable by its owner only (kvmesh up and
    compose's set-up step); an existing file is kept, so a restarted stack keeps its secret."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(secrets.token_hex(32) + "\n")
    return path


def main(argv: list[str]) -> int:
    """`python -m kvmesh.mesh_keys PATH`: writes a mesh secret to PATH unless one is there
    (compose's set-up step)."""
    if len(argv) != 1:
        print("usage: python -m kvmesh.mesh_keys PATH", file=sys.stderr)
        return 2
    write_secret_file(Path(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
