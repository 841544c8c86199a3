"""Idempotency keys: first result replayed, concurrent repeats wait, failures free the key."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.errors import InvalidArgument
from services.admission.idempotency import Claim, IdempotencyStore
from tests.fake_clock import FakeClock


async def test_a_repeated_key_returns_the_first_result() -> None:
    store = IdempotencyStore[str](capacity=4, ttl_s=60)
    claim = await store.claim("acme", "k", b"req")
    assert isinstance(claim, Claim)
    store.finish(claim, "answer")
    assert await store.claim("acme", "k", b"req") == "answer"
    # Keys are per tenant.
    assert isinstance(await store.claim("beta", "k", b"req"), Claim)


async def test_a_repeat_during_the_first_waits_for_its_result() -> None:
    store = IdempotencyStore[str](capacity=4, ttl_s=60)
    claim = await store.claim("acme", "k", b"req")
    assert isinstance(claim, Claim)
    repeat = asyncio.create_task(store.claim("acme", "k", b"req"))
    await asyncio.sleep(0.01)
    assert not repeat.done()
    store.finish(claim, "answer")
    assert await repeat == "answer"


async def test_an_abandoned_key_lets_one_repeat_run() -> None:
    store = IdempotencyStore[str](capacity=4, ttl_s=60)
    claim = await store.claim("acme", "k", b"req")
    assert isinstance(claim, Claim)
    repeats = [asyncio.create_task(store.claim("acme", "k", b"req")) for _ in range(2)]
    await asyncio.sleep(0.01)
    store.abandon(claim)
    await asyncio.sleep(0.01)
    done = [r for r in repeats if r.done()]
    assert len(done) == 1 and isinstance(done[0].result(), Claim)
    second = done[0].result()
    assert isinstance(second, Claim)
    store.finish(second, "retry answer")
    assert await asyncio.wait_for(repeats[1 - repeats.index(done[0])], 1.0) == "retry answer"


async def test_a_key_reused_for_another_request_is_refused() -> None:
    store = IdempotencyStore[str](capacity=4, ttl_s=60)
    claim = await store.claim("acme", "k", b"req")
    assert isinstance(claim, Claim)
    store.finish(claim, "answer")
    with pytest.raises(InvalidArgument) as raised:
        await store.claim("acme", "k", b"other")
    assert raised.value.field == "idempotency_key"


async def test_memory_is_bounded_and_entries_expire() -> None:
    clock = FakeClock()
    store = IdempotencyStore[str](capacity=2, ttl_s=10, clock=clock)
    for key in "abc":
        claim = await store.claim("t", key, b"r")
        assert isinstance(claim, Claim)
        store.finish(claim, key)
    assert len(store) == 2
    assert isinstance(await store.claim("t", "a", b"r"), Claim)  # the oldest was dropped
    assert await store.claim("t", "c", b"r") == "c"
    clock.now = 11
    assert isinstance(await store.claim("t", "c", b"r"), Claim)
