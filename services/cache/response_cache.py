"""The response cache's rules: what is stored, under which key, and what a failure means.

Only deterministic answers (greedy, or a fixed seed) that ended normally are stored. A
backend failure is logged and counted and answered as a miss; while the backend is failing
it is skipped for `retry_s` so that a dead Redis adds no latency to every request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvmesh.contracts.sampling import is_deterministic
from kvmesh.v1 import cache_pb2, common_pb2
from services.cache import metrics
from services.cache.backends import BackendUnavailable, CacheBackend
from services.cache.keys import cache_key

log = logging.getLogger(__name__)

STORABLE_FINISH = frozenset({common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH})


@dataclass(slots=True)
class Counters:
    """Lookup and store outcomes since start."""

    hits: int = 0
    misses: int = 0
    stores: int = 0
    backend_errors: int = 0


class ResponseCache:
    """Lookup / store / invalidate over one backend, failing open."""

    def __init__(self, backend: CacheBackend, max_entry_bytes: int, retry_s: float) -> None:
        self.backend = backend
        self.max_entry_bytes = max_entry_bytes
        self.retry_s = retry_s
        self.counters = Counters()
        self._skip_until = 0.0

    def _backend_usable(self) -> bool:
        return time.monotonic() >= self._skip_until

    def _backend_failed(self, operation: str, error: BackendUnavailable) -> None:
        self.counters.backend_errors += 1
        metrics.BACKEND_ERRORS.labels(self.backend.name, operation).inc()
        self._skip_until = time.monotonic() + self.retry_s
        log.warning("cache backend %s failed during %s: %s", self.backend.name, operation, error)

    def _miss(self) -> None:
        self.counters.misses += 1
        metrics.LOOKUPS.labels(self.backend.name, "miss").inc()

    async def lookup(self, key: cache_pb2.CacheKey) -> cache_pb2.CachedResponse | None:
        """The stored answer, or None on a miss (including an unreachable backend)."""
        if not is_deterministic(key.sampling) or not self._backend_usable():
            self._miss()
            return None
        try:
            raw = await self.backend.get(cache_key(key))
        except BackendUnavailable as error:
            self._backend_failed("lookup", error)
            raw = None
        if raw is None:
            self._miss()
            return None
        self.counters.hits += 1
        metrics.LOOKUPS.labels(self.backend.name, "hit").inc()
        return cache_pb2.CachedResponse.FromString(raw)

    def refusal(self, key: cache_pb2.CacheKey, response: cache_pb2.CachedResponse) -> str | None:
        """Why this answer must not be stored, or None when it may be."""
        if not is_deterministic(key.sampling):
            return "not deterministic: temperature > 0 without a seed"
        if response.finish_reason not in STORABLE_FINISH:
            return "generation did not finish normally"
        if response.ByteSize() > self.max_entry_bytes:
            return f"entry larger than {self.max_entry_bytes} bytes"
        return None

    async def store(
        self, key: cache_pb2.CacheKey, response: cache_pb2.CachedResponse
    ) -> str | None:
        """Stores the answer; returns the reason when it was not stored."""
        reason = self.refusal(key, response)
        if reason is None and not self._backend_usable():
            reason = "backend unavailable"
        if reason is not None:
            return reason
        stamped = cache_pb2.CachedResponse()
        stamped.CopyFrom(response)
        stamped.stored_unix_ms = int(time.time() * 1000)
        try:
            await self.backend.put(cache_key(key), key.model, stamped.SerializeToString())
        except BackendUnavailable as error:
            self._backend_failed("store", error)
            return "backend unavailable"
        self.counters.stores += 1
        metrics.STORES.labels(self.backend.name).inc()
        return None

    async def invalidate(self, request: cache_pb2.InvalidateRequest) -> int:
        """Removes one entry, a model tier's entries, or everything; returns how many."""
        target = request.WhichOneof("target")
        if target == "key":
            return await self.backend.delete(cache_key(request.key))
        if target == "model":
            return await self.backend.delete_model(request.model)
        if target == "all" and request.all:
            return await self.backend.clear()
        return 0
