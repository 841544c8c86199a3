"""Lease TTL bookkeeping, who may use a lease, and the sweeper."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.errors import NotFound, PermissionDenied
from services.worker.leases import LeaseRecord, LeaseSweeper, LeaseTable
from tests.fake_clock import FakeClock

ROUTER = "router"
PULLER = "127.0.0.1:50062"
HOLDERS = frozenset({ROUTER, PULLER})


def test_grant_get_take() -> None:
    clock = FakeClock(100.0)
    table = LeaseTable(ttl_s=30.0, clock=clock, wall_clock=lambda: 1000.0)
    lease = table.grant("h1", [b"a", b"b"], 20, HOLDERS)
    assert table.get(lease.lease_id, PULLER) is lease
    assert lease.expires_at == 130.0
    assert lease.expires_unix_ms == 1_030_000
    assert len(lease.lease_id) == 32
    assert table.take(lease.lease_id, ROUTER) is lease
    assert len(table) == 0
    with pytest.raises(NotFound):
        table.get(lease.lease_id, PULLER)
    with pytest.raises(NotFound):
        table.take("nope", ROUTER)


@pytest.mark.parametrize("stranger", ["", "127.0.0.1:50063", "gateway"])
def test_a_lease_serves_only_its_holders(stranger: str) -> None:
    table = LeaseTable(ttl_s=30.0, clock=FakeClock(100.0))
    lease = table.grant("h1", [b"a"], 3, HOLDERS)
    with pytest.raises(PermissionDenied, match="not granted"):
        table.get(lease.lease_id, stranger)
    with pytest.raises(PermissionDenied, match="not granted"):
        table.take(lease.lease_id, stranger)
    assert table.get(lease.lease_id, PULLER) is lease  # a refused take leaves it in place
    assert table.drop(lease.lease_id) is lease  # the worker's own clean-up needs no holder
    assert table.drop(lease.lease_id) is None


def test_a_caller_may_shorten_the_ttl_never_lengthen_it() -> None:
    clock = FakeClock(100.0)
    table = LeaseTable(ttl_s=30.0, clock=clock)
    assert table.grant("h", [b"a"], 1, HOLDERS, ttl_s=0.5).expires_at == 100.5
    assert table.grant("h2", [b"a"], 1, HOLDERS, ttl_s=0).expires_at == 130.0
    # 2^32-1 ms (49 days) asked for: the worker's 30 s.
    assert table.grant("h3", [b"a"], 1, HOLDERS, ttl_s=(2**32 - 1) / 1000).expires_at == 130.0


def test_expired_lease_is_not_found_before_the_sweep() -> None:
    clock = FakeClock(100.0)
    table = LeaseTable(ttl_s=1.0, clock=clock)
    lease = table.grant("h1", [b"a"], 3, HOLDERS)
    clock.now += 1.0
    with pytest.raises(NotFound, match="expired"):
        table.get(lease.lease_id, PULLER)
    assert len(table) == 1  # still to be swept, so its blocks get released


def test_take_expired_keeps_live_leases() -> None:
    clock = FakeClock(100.0)
    table = LeaseTable(ttl_s=1.0, clock=clock)
    old = table.grant("old", [b"a"], 3, HOLDERS)
    clock.now += 0.6
    young = table.grant("young", [b"b"], 3, HOLDERS)
    clock.now += 0.6
    assert table.take_expired() == [old]
    assert table.get(young.lease_id, PULLER) is young
    assert table.take_all() == [young]
    assert len(table) == 0


async def test_sweeper_releases_expired_leases() -> None:
    clock = FakeClock(100.0)
    table = LeaseTable(ttl_s=10.0, clock=clock)
    released: list[str] = []
    ticks: list[int] = []

    async def release(lease: LeaseRecord) -> None:
        if lease.handle_id == "bad":
            raise RuntimeError("engine refused")
        released.append(lease.handle_id)

    sweeper = LeaseSweeper(table, release, interval_s=0.01, also=lambda: ticks.append(1))
    table.grant("bad", [b"a"], 1, HOLDERS, ttl_s=1.0)
    table.grant("h1", [b"a"], 1, HOLDERS, ttl_s=1.0)
    table.grant("h2", [b"a"], 1, HOLDERS)
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
