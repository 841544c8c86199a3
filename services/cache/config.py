"""Configuration of the response cache service."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvmesh.config import ServerConfig


@dataclass(slots=True, frozen=True)
class CacheConfig(ServerConfig):
    """Settings of `python -m services.cache`."""

    env_prefix: ClassVar[str] = "KVMESH_CACHE_"

    port: int = 50053
    """gRPC port; 0 picks a free one."""
    metrics_port: int = 9453
    """Prometheus metrics HTTP port; 0 picks a free one, -1 disables it."""
    redis: str = ""
    """Redis URL (redis://host:port/db); empty keeps entries in process memory."""
    max_bytes: int = 64 * 1024 * 1024
    """Byte cap of the in-memory backend; least recently used entries are evicted past it."""
    max_entry_bytes: int = 1024 * 1024
    """Largest single entry stored (either backend); bigger answers are not cached."""
    ttl_s: int = 3600
    """Time-to-live of every Redis key, in seconds."""
    key_prefix: str = "kvmesh:cache:"
    """Prefix of every Redis key, so several meshes can share one Redis."""
    redis_retry_s: float = 1.0
    """After a Redis failure, treat lookups as misses for this long before trying Redis again."""
