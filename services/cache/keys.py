"""Response-cache keys: a hash of every field that changes a deterministic answer."""

from __future__ import annotations

import hashlib
import struct

from kvmesh.v1 import cache_pb2, common_pb2

SHARED_SCOPE = "shared"
"""Scope of entries from tenants that opted into the shared cache."""


def _sampling_fields(sampling: common_pb2.SamplingParams) -> bytes:
    """Every sampling field with its presence, in field-number order (unset differs from zero)."""
    parts: list[bytes] = []
    for field in common_pb2.SamplingParams.DESCRIPTOR.fields:
        value = getattr(sampling, field.name)
        if field.is_repeated:
            parts.append(f"{field.number}:{list(value)!r}".encode())
        elif field.has_presence and not sampling.HasField(field.name):  # type: ignore[arg-type]
            parts.append(f"{field.number}:unset".encode())
        elif field.message_type is not None:  # a grammar or choice constraint: its exact bytes
            parts.append(f"{field.number}:".encode() + value.SerializeToString(deterministic=True))
        else:
            parts.append(f"{field.number}:{value!r}".encode())
    return b"\x1f".join(parts)


def cache_key(key: cache_pb2.CacheKey) -> str:
    """Hex SHA-256 over model, fingerprint, exact prompt tokens, sampling and tenant scope."""
    scope = SHARED_SCOPE if key.shared else f"tenant:{key.tenant}"
    digest = hashlib.sha256()
    for part in (key.model.encode(), key.model_fingerprint.encode(), scope.encode()):
        digest.update(struct.pack("<I", len(part)))
        digest.update(part)
    digest.update(
        struct.pack(
            f"<I{len(key.prompt_token_ids)}I", len(key.prompt_token_ids), *key.prompt_token_ids
        )
    )
    digest.update(_sampling_fields(key.sampling))
    return digest.hexdigest()
