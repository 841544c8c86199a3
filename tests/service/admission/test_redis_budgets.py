"""Budgets and usage meters in the real Redis (127.0.0.1:6379), each test under its own prefix."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis

from kvmesh.errors import ResourceExhausted
from kvmesh.tenants import Tenant
from services.admission.metering import ModelTotals, RedisMeter
from services.admission.quotas import MemoryCounters, Quotas, RedisCounters

ACME = Tenant(name="acme", key_sha256="", tokens_per_minute=1000, daily_tokens=5000)


def mid_minute() -> float:
    """A fixed clock in the middle of the current minute: counting tests never straddle two
    fixed one-minute windows, however slow the machine."""
    frozen = (time.time() // 60) * 60 + 30
    return frozen


async def test_two_gateways_share_one_budget(redis: tuple[Redis, str]) -> None:
    client, prefix = redis
    now = mid_minute()
    first = Quotas(RedisCounters(client, prefix), fallback=MemoryCounters(), clock=lambda: now)
    second = Quotas(RedisCounters(client, prefix), fallback=MemoryCounters(), clock=lambda: now)
    held = await first.reserve(ACME, 600)
    with pytest.raises(ResourceExhausted) as raised:
        await second.reserve(ACME, 600)
    assert raised.value.retry_after_s is not None and 0 < raised.value.retry_after_s <= 60
    await first.settle(held, 100)
    await second.reserve(ACME, 600)
    assert await first.used(ACME) == (700, 700)


async def test_concurrent_reservations_never_overshoot(redis: tuple[Redis, str]) -> None:
    client, prefix = redis
    now = mid_minute()
    gateways = [Quotas(RedisCounters(client, prefix), clock=lambda: now) for _ in range(4)]

    async def try_reserve(quotas: Quotas) -> bool:
        try:
            await quotas.reserve(ACME, 30)
        except ResourceExhausted:
            return False
        return True

    results = await asyncio.gather(*(try_reserve(gateways[i % 4]) for i in range(60)))
    assert sum(results) == 1000 // 30
    minute, _ = await gateways[0].used(ACME)
    assert minute == (1000 // 30) * 30


async def test_counters_expire(redis: tuple[Redis, str]) -> None:
    client, prefix = redis
    await Quotas(RedisCounters(client, prefix)).reserve(ACME, 10)
    keys = [key async for key in client.scan_iter(match=prefix + "*")]
    assert len(keys) == 2
    for key in keys:
        assert 0 < await client.ttl(key) <= 86_400 + 60


async def test_unreachable_redis_counts_locally(unreachable_redis: Redis) -> None:
    quotas = Quotas(RedisCounters(unreachable_redis, "unused:"), fallback=MemoryCounters())
    await quotas.reserve(ACME, 900)
    with pytest.raises(ResourceExhausted):
        await quotas.reserve(ACME, 200)
    assert await quotas.used(ACME) == (900, 900)


async def test_usage_meter_sums_across_gateways(redis: tuple[Redis, str]) -> None:
    client, prefix = redis
    for _ in range(2):
        meter = RedisMeter(client, prefix)
        await meter.record("acme", "tiny", ModelTotals(1, 10, 4, 20, 0, 0.5))
    totals = await RedisMeter(client, prefix).totals("acme")
    assert totals == {"tiny": ModelTotals(2, 20, 8, 40, 0, 1.0)}
