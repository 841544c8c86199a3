"""Tenants' request slots as leases in the real Redis (127.0.0.1:6379), each test under its own
prefix; every RedisSlots instance stands for one gateway."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from prometheus_client import REGISTRY
from redis.asyncio import Redis

from services.admission.concurrency import ConcurrencyLimits, MemorySlots, RedisSlots

Gateways = Callable[..., Awaitable[tuple[ConcurrencyLimits, RedisSlots]]]


@pytest.fixture
async def gateway_slots(redis: tuple[Redis, str]) -> AsyncIterator[Gateways]:
    """Makes the slot books of one gateway on the shared Redis (renewals stopped afterwards)."""
    client, prefix = redis
    made: list[RedisSlots] = []

    async def make(lease_s: float = 30.0) -> tuple[ConcurrencyLimits, RedisSlots]:
        slots = RedisSlots(client, prefix, lease_s)
        made.append(slots)
        return ConcurrencyLimits(slots, fallback=MemorySlots()), slots

    yield make
    for slots in made:
        await slots.close()


async def test_slots_are_shared_up_to_the_limit_and_a_release_frees_one(
    redis: tuple[Redis, str], gateway_slots: Gateways
) -> None:
    client, prefix = redis
    first, _ = await gateway_slots()
    second, _ = await gateway_slots()
    held = [await first.acquire("acme", 2), await second.acquire("acme", 2)]
    assert all(held)
    assert await first.acquire("acme", 2) is None
    assert await second.acquire("acme", 2) is None
    assert await second.acquire("other", 1) is not None  # limits are per tenant
    assert held[0] is not None
    await first.release(held[0])
    assert await second.acquire("acme", 2) is not None
    key = f"{prefix}slots:{{acme}}"
    assert await client.zcard(key) == 2
    assert 0 < await client.pttl(key) <= 30_000  # the key ends with its last lease


async def test_concurrent_acquires_never_overshoot(gateway_slots: Gateways) -> None:
    limits = [(await gateway_slots())[0] for _ in range(4)]
    taken = await asyncio.gather(*(limits[i % 4].acquire("acme", 3) for i in range(20)))
    assert sum(slot is not None for slot in taken) == 3


async def test_the_slot_of_a_dead_gateway_is_reclaimed_when_its_lease_ends(
    gateway_slots: Gateways,
) -> None:
    dead, dead_slots = await gateway_slots(lease_s=0.5)
    assert await dead.acquire("acme", 1) is not None
    await dead_slots.close()  # no more renewals: what Redis sees of a gateway that died
    live, _ = await gateway_slots()
    assert await live.acquire("acme", 1) is None
    await asyncio.sleep(0.7)
    assert await live.acquire("acme", 1) is not None


async def test_a_long_request_keeps_its_slot_through_renewals(gateway_slots: Gateways) -> None:
    holder, _ = await gateway_slots(lease_s=1.0)
    other, _ = await gateway_slots()
    slot = await holder.acquire("acme", 1)
    assert slot is not None
    await asyncio.sleep(2.5)  # more than two leases: only renewals (every 1/3 s) keep it
    assert await other.acquire("acme", 1) is None
    await holder.release(slot)
    assert await other.acquire("acme", 1) is not None


async def test_renewing_never_brings_back_a_slot_taken_over(
    redis: tuple[Redis, str], gateway_slots: Gateways
) -> None:
    client, prefix = redis
    limits, slots = await gateway_slots()
    assert await limits.acquire("acme", 1) is not None
    key = f"{prefix}slots:{{acme}}"
    # As if its lease had ended and another gateway had taken the slot over.
    await client.delete(key)
    await client.zadd(key, {"another-gateway": 1e15})
    await slots.renew()
    assert await client.zrange(key, 0, -1) == [b"another-gateway"]


async def test_unreachable_redis_counts_slots_locally(unreachable_redis: Redis) -> None:
    labels = {"backend": "concurrency"}
    errors_before = REGISTRY.get_sample_value("kvmesh:admission_backend_errors_total", labels)
    limits = ConcurrencyLimits(RedisSlots(unreachable_redis, "unused:", 30.0), MemorySlots())
    slot = await limits.acquire("acme", 1)
    assert slot is not None and slot.store.name == "memory"
    assert await limits.acquire("acme", 1) is None
    await limits.release(slot)
    assert await limits.acquire("acme", 1) is not None
    errors = REGISTRY.get_sample_value("kvmesh:admission_backend_errors_total", labels)
    # One failed call: the next ones within RETRY_S go straight to the local count.
    assert (errors or 0) - (errors_before or 0) == 1
