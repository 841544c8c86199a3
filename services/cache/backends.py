"""Where cached answers live: process memory (LRU with a byte cap) or Redis (TTL on every key).

A backend stores opaque bytes under a key and indexes keys by model tier so that a tier
can be invalidated at once. Redis failures raise `BackendUnavailable`; the response cache
above turns them into misses.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError


class BackendUnavailable(Exception):
    """The backend could not be reached; the caller treats it as a miss."""


@dataclass(slots=True)
class BackendStats:
    """What a backend holds now."""

    entries: int
    """Entries held."""
    bytes: int
    """Bytes held (values only)."""
    evictions: int
    """Entries dropped to respect the byte cap."""


class CacheBackend(Protocol):
    """Storage of cache entries."""

    name: str

    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, model: str, value: bytes) -> None: ...

    async def delete(self, key: str) -> int: ...

    async def delete_model(self, model: str) -> int: ...

    async def clear(self) -> int: ...

    async def stats(self) -> BackendStats: ...

    async def close(self) -> None: ...


@dataclass
class MemoryBackend:
    """An LRU dictionary bounded by the total size of its values."""

    max_bytes: int
    name: str = "memory"
    _entries: OrderedDict[str, tuple[str, bytes]] = field(default_factory=OrderedDict)
    _bytes: int = 0
    _evictions: int = 0

    async def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[1]

    async def put(self, key: str, model: str, value: bytes) -> None:
        await self.delete(key)
        self._entries[key] = (model, value)
        self._bytes += len(value)
        while self._bytes > self.max_bytes and self._entries:
            _, (_, evicted) = self._entries.popitem(last=False)
            self._bytes -= len(evicted)
            self._evictions += 1

    async def delete(self, key: str) -> int:
        entry = self._entries.pop(key, None)
        if entry is None:
            return 0
        self._bytes -= len(entry[1])
        return 1

    async def delete_model(self, model: str) -> int:
        doomed = [key for key, (owner, _) in self._entries.items() if owner == model]
        for key in doomed:
            await self.delete(key)
        return len(doomed)

    async def clear(self) -> int:
        removed = len(self._entries)
        self._entries.clear()
        self._bytes = 0
        return removed

    async def stats(self) -> BackendStats:
        return BackendStats(len(self._entries), self._bytes, self._evictions)

    async def close(self) -> None:
        return None


class RedisBackend:
    """Entries as Redis strings with a TTL, plus one set per model tier naming its keys."""

    name = "redis"

    def __init__(self, url: str, prefix: str, ttl_s: int) -> None:
        self._redis = aioredis.Redis.from_url(
            url, socket_connect_timeout=0.25, socket_timeout=0.5, retry_on_timeout=False
        )
        self._prefix = prefix
        self._ttl_s = ttl_s

    def _entry(self, key: str) -> str:
        return f"{self._prefix}entry:{key}"

    def _model_index(self, model: str) -> str:
        return f"{self._prefix}model:{model}"

    async def get(self, key: str) -> bytes | None:
        try:
            value = await self._redis.get(self._entry(key))
        except (RedisError, OSError) as exc:
            raise BackendUnavailable(str(exc)) from exc
        return value if isinstance(value, bytes) else None

    async def put(self, key: str, model: str, value: bytes) -> None:
        index = self._model_index(model)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(self._entry(key), value, ex=self._ttl_s)
                pipe.sadd(index, key)
                pipe.expire(index, self._ttl_s)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise BackendUnavailable(str(exc)) from exc

    async def delete(self, key: str) -> int:
        try:
            removed: int = await self._redis.delete(self._entry(key))
        except (RedisError, OSError) as exc:
            raise BackendUnavailable(str(exc)) from exc
        return removed

    async def delete_model(self, model: str) -> int:
        index = self._model_index(model)
        try:
            members = await self._redis.smembers(index)  # type: ignore[misc]
            keys = [k.decode() if isinstance(k, bytes) else str(k) for k in members]
            removed: int = await self._redis.delete(*map(self._entry, keys)) if keys else 0
            await self._redis.delete(index)
        except (RedisError, OSError) as exc:
            raise BackendUnavailable(str(exc)) from exc
        return removed

    async def clear(self) -> int:
        entry_prefix = self._entry("").encode()
        removed = 0
        try:
            async for name in self._redis.scan_iter(match=f"{self._prefix}*", count=500):
                removed += name.startswith(entry_prefix)
                await self._redis.delete(name)
        except (RedisError, OSError) as exc:
            raise BackendUnavailable(str(exc)) from exc
        return removed

    async def stats(self) -> BackendStats:
        entries = 0
        size = 0
        try:
            async for name in self._redis.scan_iter(match=f"{self._prefix}entry:*", count=500):
                entries += 1
                size += int(await self._redis.strlen(name))
        except (RedisError, OSError) as exc:
            raise BackendUnavailable(str(exc)) from exc
        return BackendStats(entries, size, evictions=0)

    async def close(self) -> None:
        await self._redis.aclose()
