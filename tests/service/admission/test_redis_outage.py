"""The gateway's books through a Redis that hangs, dies and comes back (a private redis-server
on a port of its own, stopped with SIGSTOP/SIGCONT, killed and restarted)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis.asyncio import Redis

from kvmesh.tenants import Tenant
from services.admission.concurrency import ConcurrencyLimits, MemorySlots, RedisSlots
from services.admission.quotas import MemoryCounters, Quotas, RedisCounters

ACME = Tenant(name="acme", key_sha256="", daily_tokens=100_000, max_concurrent=2)
PREFIX = "test:outage:"


@dataclass
class PrivateRedis:
    """A redis-server of this test's own, persisting with AOF into `folder`."""

    port: int
    folder: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port),
             "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--dir", str(self.folder)],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def signal(self, number: int) -> None:
        assert self.process is not None
        os.kill(self.process.pid, number)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            self.process.wait(10)


@pytest.fixture
async def private_redis(tmp_path: Path) -> AsyncIterator[tuple[PrivateRedis, Redis]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    server = PrivateRedis(port, tmp_path)
    server.start()
    client = Redis.from_url(
        f"redis://127.0.0.1:{port}/0", socket_timeout=0.2, socket_connect_timeout=0.2
    )
    try:
        yield server, client
    finally:
        await client.aclose()
        server.stop()


async def within(seconds: float, check: Callable[[], object]) -> float:
    """Polls the coroutine function `check` until it returns True; the seconds it took."""
    started = time.monotonic()
    while not await check():  # type: ignore[misc]
        assert time.monotonic() - started < seconds, f"not within {seconds} s: {check.__doc__}"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def test_slots_released_during_a_hang_are_free_within_a_second_of_its_end(
    private_redis: tuple[PrivateRedis, Redis],
) -> None:
    server, client = private_redis
    slots = RedisSlots(client, PREFIX, lease_s=30.0)
    limits = ConcurrencyLimits(slots, fallback=MemorySlots())
    try:
        held = [await limits.acquire("acme", 2), await limits.acquire("acme", 2)]
        assert all(held)
        server.signal(signal.SIGSTOP)
        for slot in held:
            assert slot is not None
            await limits.release(slot)  # fails: Redis does not answer
        await asyncio.sleep(2.0)
        server.signal(signal.SIGCONT)

        async def freed() -> bool:
            """both slots back in Redis"""
            return await client.zcard(f"{PREFIX}slots:{{acme}}") == 0

        await within(1.0, freed)
        again = [await limits.acquire("acme", 2), await limits.acquire("acme", 2)]
        assert all(slot is not None and slot.store is slots for slot in again)
    finally:
        await slots.close()


async def test_counts_made_during_an_outage_are_merged_into_the_redis_that_returns(
    private_redis: tuple[PrivateRedis, Redis],
) -> None:
    """Redis dies with 100 tokens counted (kept by its AOF); 300 more are counted locally
    while it is down; once it is back it holds all 400, and a reservation made during the
    outage settles against it."""
    server, client = private_redis
    now = (time.time() // 60) * 60 + 30
    quotas = Quotas(RedisCounters(client, PREFIX), fallback=MemoryCounters(), clock=lambda: now)
    before = await quotas.reserve(ACME, 150)
    await quotas.settle(before, 100)
    server.stop()
    during = await quotas.reserve(ACME, 200)
    await quotas.settle(during, 200)
    open_reservation = await quotas.reserve(ACME, 250)
    server.start()

    async def merged() -> bool:
        """Redis counts 100 from before, 200 settled and 250 reserved during the outage"""
        await quotas.used(ACME)  # any call finds Redis back
        raw = await client.get(f"{PREFIX}quota:{{acme}}:day:{int(now // 86_400)}")
        return raw is not None and int(raw) == 550

    await within(1.0, merged)
    await quotas.settle(open_reservation, 100)
    assert await quotas.used(ACME) == (400, 400)


async def test_a_budget_settle_during_a_hang_lands_within_a_second_of_its_end(
    private_redis: tuple[PrivateRedis, Redis],
) -> None:
    """A request that reserved 1,000 tokens and used 100 settles while Redis hangs: the
    settle is retried, so Redis counts 100 within a second of answering again (before: the
    1,000 stayed counted until the day's window ended)."""
    server, client = private_redis
    now = (time.time() // 60) * 60 + 30
    quotas = Quotas(RedisCounters(client, PREFIX), fallback=MemoryCounters(), clock=lambda: now)
    try:
        reservation = await quotas.reserve(ACME, 1000)
        server.signal(signal.SIGSTOP)
        await quotas.settle(reservation, 100)  # fails: Redis does not answer
        await asyncio.sleep(1.0)
        server.signal(signal.SIGCONT)

        async def settled() -> bool:
            """Redis counts the 100 tokens used, not the 1,000 reserved"""
            raw = await client.get(f"{PREFIX}quota:{{acme}}:day:{int(now // 86_400)}")
            return raw is not None and int(raw) == 100

        await within(1.0, settled)
    finally:
        await quotas.close()


async def test_slots_taken_during_an_outage_count_in_redis_within_a_second_of_its_end(
    private_redis: tuple[PrivateRedis, Redis],
) -> None:
    """A request admitted while Redis hangs holds a slot counted by its gateway alone; once
    Redis answers the slot is added to it within a second, without waiting for another
    request, so a second gateway then finds one of the tenant's two slots left (before: two)."""
    server, client = private_redis
    key = f"{PREFIX}slots:{{acme}}"
    first_slots, second_slots = (RedisSlots(client, PREFIX, lease_s=30.0) for _ in range(2))
    first = ConcurrencyLimits(first_slots, fallback=MemorySlots())
    second = ConcurrencyLimits(second_slots, fallback=MemorySlots())
    try:
        server.signal(signal.SIGSTOP)
        running = await first.acquire("acme", 2)
        assert running is not None and running.store is not first_slots  # counted locally
        await asyncio.sleep(0.5)
        server.signal(signal.SIGCONT)

        async def adopted() -> bool:
            """the slot taken during the outage is in Redis"""
            return await client.zcard(key) == 1

        await within(1.0, adopted)
        assert await second.acquire("acme", 2) is not None
        assert await second.acquire("acme", 2) is None  # the limit holds across gateways
        await first.release(running)  # given back where it is counted now: Redis
        assert await client.zcard(key) == 1
        assert await second.acquire("acme", 2) is not None
    finally:
        for closing in (first, second, first_slots, second_slots):
            await closing.close()
