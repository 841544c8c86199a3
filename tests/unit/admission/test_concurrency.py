"""Tenants' request slots in memory, and failing open when the shared store is down."""

from __future__ import annotations

from services.admission.concurrency import ConcurrencyLimits, MemorySlots
from services.admission.failover import StoreDown


class DownSlots:
    """A shared store that cannot be reached."""

    name = "redis"

    async def try_acquire(self, tenant: str, holder: str, limit: int) -> bool:
        raise StoreDown("connection refused")

    async def release(self, tenant: str, holder: str) -> None:
        raise StoreDown("connection refused")

    async def adopt(self, tenant: str, holder: str) -> None:
        raise StoreDown("connection refused")


async def test_slots_up_to_the_limit_per_tenant() -> None:
    limits = ConcurrencyLimits(MemorySlots())
    first = await limits.acquire("acme", 2)
    assert first is not None and await limits.acquire("acme", 2) is not None
    assert await limits.acquire("acme", 2) is None
    assert await limits.acquire("other", 1) is not None
    await limits.release(first)
    await limits.release(first)  # a second release frees nothing more
    assert await limits.acquire("acme", 2) is not None
    assert await limits.acquire("acme", 2) is None


async def test_a_store_down_counts_on_the_fallback_and_gives_back_there() -> None:
    limits = ConcurrencyLimits(DownSlots(), fallback=MemorySlots())
    slot = await limits.acquire("acme", 1)
    assert slot is not None and slot.store.name == "memory"
    assert await limits.acquire("acme", 1) is None
    await limits.release(slot)
    assert await limits.acquire("acme", 1) is not None
    await limits.close()


async def test_without_a_fallback_a_store_down_admits_and_release_does_not_raise() -> None:
    limits = ConcurrencyLimits(DownSlots())
    slots = [await limits.acquire("acme", 1) for _ in range(3)]
    assert all(slots)
    for slot in slots:
        assert slot is not None
        await limits.release(slot)
