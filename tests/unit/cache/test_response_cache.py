"""The response cache's storage rules and the memory backend's LRU byte cap."""

from __future__ import annotations

from kvmesh.v1 import cache_pb2, common_pb2
from services.cache.backends import BackendStats, BackendUnavailable, MemoryBackend
from services.cache.response_cache import ResponseCache


def key(tokens: list[int], temperature: float = 0.0, seed: int | None = None) -> cache_pb2.CacheKey:
    sampling = common_pb2.SamplingParams(temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    return cache_pb2.CacheKey(
        model="m", model_fingerprint="f", prompt_token_ids=tokens, sampling=sampling, tenant="t"
    )


def answer(
    text: str, reason: common_pb2.FinishReason.ValueType = common_pb2.FINISH_REASON_STOP
) -> cache_pb2.CachedResponse:
    return cache_pb2.CachedResponse(token_ids=[5, 6], text=text, finish_reason=reason, model="m")


async def test_memory_backend_evicts_least_recently_used_past_byte_cap() -> None:
    backend = MemoryBackend(max_bytes=10)
    await backend.put("a", "m", b"1234")
    await backend.put("b", "m", b"1234")
    assert await backend.get("a") == b"1234"  # a is now most recent
    await backend.put("c", "m", b"1234")  # 12 bytes > 10: evicts b, the least recent
    assert await backend.get("b") is None
    assert await backend.get("a") == b"1234"
    assert await backend.stats() == BackendStats(entries=2, bytes=8, evictions=1)


async def test_memory_backend_invalidates_by_model() -> None:
    backend = MemoryBackend(max_bytes=100)
    await backend.put("a", "m1", b"x")
    await backend.put("b", "m2", b"y")
    assert await backend.delete_model("m1") == 1
    assert await backend.get("a") is None
    assert await backend.get("b") == b"y"


async def test_stores_deterministic_answers_and_hits() -> None:
    cache = ResponseCache(MemoryBackend(1 << 20), max_entry_bytes=1 << 16, retry_s=1.0)
    assert await cache.lookup(key([1, 2])) is None
    assert await cache.store(key([1, 2]), answer("hi")) is None
    found = await cache.lookup(key([1, 2]))
    assert found is not None and found.text == "hi" and found.stored_unix_ms > 0
    assert (cache.counters.hits, cache.counters.misses, cache.counters.stores) == (1, 1, 1)


async def test_refuses_sampled_unfinished_and_oversized_answers() -> None:
    cache = ResponseCache(MemoryBackend(1 << 20), max_entry_bytes=64, retry_s=1.0)
    assert "not deterministic" in (await cache.store(key([1], temperature=0.7), answer("x")) or "")
    assert await cache.store(key([1], temperature=0.7, seed=3), answer("x")) is None
    aborted = answer("x", common_pb2.FINISH_REASON_ABORT)
    assert "did not finish" in (await cache.store(key([2]), aborted) or "")
    assert "larger than" in (await cache.store(key([3]), answer("y" * 100)) or "")
    assert cache.counters.stores == 1


class FailingBackend(MemoryBackend):
    async def get(self, key: str) -> bytes | None:
        raise BackendUnavailable("connection refused")


async def test_backend_failure_is_a_counted_miss_then_skipped() -> None:
    backend = FailingBackend(1 << 20)
    cache = ResponseCache(backend, max_entry_bytes=1 << 16, retry_s=60.0)
    assert await cache.lookup(key([1])) is None
    assert await cache.lookup(key([1])) is None  # skipped: no second backend call
    assert cache.counters.backend_errors == 1
    assert cache.counters.misses == 2
    assert await cache.store(key([1]), answer("x")) == "backend unavailable"
