"""Token budgets in memory: reserve, settle, release, windows and retry-after."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidArgument, ResourceExhausted
from kvmesh.tenants import Tenant
from services.admission.quotas import MemoryCounters, Quotas
from tests.fake_clock import FakeClock

ACME = Tenant(name="acme", key_sha256="", tokens_per_minute=100, daily_tokens=250)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_700_000_000.0 - 1_700_000_000.0 % 86_400 + 30.0)  # 30 s into a UTC day


async def test_reserve_until_the_minute_budget_is_spent(clock: FakeClock) -> None:
    quotas = Quotas(MemoryCounters(), clock=clock)
    await quotas.reserve(ACME, 60)
    await quotas.reserve(ACME, 40)
    with pytest.raises(ResourceExhausted) as raised:
        await quotas.reserve(ACME, 1)
    error = raised.value
    assert error.retry_after_s == pytest.approx(30.0)
    assert error.quota_violations[0].subject == "tenant:acme"
    assert "tokens per minute" in error.quota_violations[0].description
    assert await quotas.used(ACME) == (100, 100)


async def test_settle_gives_back_what_was_not_used(clock: FakeClock) -> None:
    quotas = Quotas(MemoryCounters(), clock=clock)
    reservation = await quotas.reserve(ACME, 90)
    await quotas.settle(reservation, 30)
    await quotas.settle(reservation, 0)  # a second settle changes nothing
    assert await quotas.used(ACME) == (30, 30)
    await quotas.reserve(ACME, 70)


async def test_release_returns_everything(clock: FakeClock) -> None:
    quotas = Quotas(MemoryCounters(), clock=clock)
    reservation = await quotas.reserve(ACME, 90)
    await quotas.release(reservation)
    assert await quotas.used(ACME) == (0, 0)


async def test_a_new_minute_starts_empty_but_the_day_remembers(clock: FakeClock) -> None:
    quotas = Quotas(MemoryCounters(), clock=clock)
    await quotas.reserve(ACME, 100)
    clock.now += 60
    await quotas.reserve(ACME, 100)
    clock.now += 60
    with pytest.raises(ResourceExhausted) as raised:
        await quotas.reserve(ACME, 100)
    assert "per day" in str(raised.value)
    assert raised.value.retry_after_s == pytest.approx(86_400 - 150.0)


async def test_settling_after_the_window_rolled_over_leaves_the_new_window_alone(
    clock: FakeClock,
) -> None:
    quotas = Quotas(MemoryCounters(), clock=clock)
    reservation = await quotas.reserve(ACME, 80)
    clock.now += 60
    await quotas.settle(reservation, 10)
    minute, day = await quotas.used(ACME)
    assert minute == 0 and day == 10


async def test_a_request_larger_than_the_whole_budget_is_invalid(clock: FakeClock) -> None:
    quotas = Quotas(MemoryCounters(), clock=clock)
    with pytest.raises(InvalidArgument) as raised:
        await quotas.reserve(ACME, 101)
    assert raised.value.field == "sampling.max_tokens"


async def test_unlimited_tenants_and_isolation(clock: FakeClock) -> None:
    quotas = Quotas(MemoryCounters(), clock=clock)
    free = Tenant(name="free", key_sha256="")
    for _ in range(10):
        await quotas.reserve(free, 10_000)
    await quotas.reserve(ACME, 100)  # free's usage is not acme's
