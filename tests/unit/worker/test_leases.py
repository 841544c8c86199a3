"""Lease TTL bookkeeping and the sweeper."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.errors import NotFound
from services.worker.leases import Lease, LeaseSweeper, LeaseTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_grant_get_take() -> None:
    clock = Clock()
    table = LeaseTable(default_ttl_s=30.0, clock=clock, wall_clock=lambda: 1000.0)
    lease = table.grant("h1", [b"a", b"b"], 20)
    assert table.get(lease.lease_id) is lease
    assert lease.expires_at == 130.0
    assert lease.expires_unix_ms == 1_030_000
    assert len(lease.lease_id) == 32
    assert table.take(lease.lease_id) is lease
    assert len(table) == 0
    with pytest.raises(NotFound):
        table.get(lease.lease_id)
    with pytest.raises(NotFound):
        table.take("nope")


def test_explicit_ttl_overrides_default() -> None:
    clock = Clock()
    table = LeaseTable(default_ttl_s=30.0, clock=clock)
    assert table.grant("h", [b"a"], 1, ttl_s=0.5).expires_at == 100.5
    assert table.grant("h2", [b"a"], 1, ttl_s=0).expires_at == 130.0


def test_expired_lease_is_not_found_before_the_sweep() -> None:
    clock = Clock()
    table = LeaseTable(default_ttl_s=1.0, clock=clock)
    lease = table.grant("h1", [b"a"], 3)
    clock.now += 1.0
    with pytest.raises(NotFound, match="expired"):
        table.get(lease.lease_id)
    assert len(table) == 1  # still to be swept, so its blocks get released


def test_take_expired_keeps_live_leases() -> None:
    clock = Clock()
    table = LeaseTable(default_ttl_s=1.0, clock=clock)
    old = table.grant("old", [b"a"], 3)
    clock.now += 0.6
    young = table.grant("young", [b"b"], 3)
    clock.now += 0.6
    assert table.take_expired() == [old]
    assert table.get(young.lease_id) is young
    assert table.take_all() == [young]
    assert len(table) == 0


async def test_sweeper_releases_expired_leases() -> None:
    clock = Clock()
    table = LeaseTable(default_ttl_s=1.0, clock=clock)
    released: list[str] = []
    ticks: list[int] = []

    async def release(lease: Lease) -> None:
        if lease.handle_id == "bad":
            raise RuntimeError("engine refused")
        released.append(lease.handle_id)

    sweeper = LeaseSweeper(table, release, interval_s=0.01, also=lambda: ticks.append(1))
    table.grant("bad", [b"a"], 1)
    table.grant("h1", [b"a"], 1)
    table.grant("h2", [b"a"], 1, ttl_s=60.0)
    sweeper.start()
    await asyncio.sleep(0.05)
    assert released == []
    clock.now += 2.0
    for _ in range(100):
        await asyncio.sleep(0.01)
        if released:
            break
    await sweeper.stop()
    # A failing release is logged and does not stop the others (or the loop).
    assert released == ["h1"]
    assert len(table) == 1
    assert ticks
