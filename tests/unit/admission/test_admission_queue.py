"""Admission queue: priority order, per-class bounds, batch share, shedding, deadlines."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvmesh.errors import DeadlineExceeded, ResourceExhausted
from kvmesh.tenants import PriorityClass
from services.admission.admission_queue import AdmissionQueue, QueueLimits, Ticket

INTERACTIVE = PriorityClass.INTERACTIVE
BATCH = PriorityClass.BATCH


def queue(max_in_flight: int = 1, batch_max: int = 1, iq: int = 8, bq: int = 8) -> AdmissionQueue:
    return AdmissionQueue(QueueLimits(max_in_flight, batch_max, iq, bq))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_free_slots_admit_at_once() -> None:
    q = queue(max_in_flight=2, batch_max=2)
    first = await q.admit(BATCH)
    second = await q.admit(INTERACTIVE)
    assert first.queued_s == 0 and second.queued_s == 0
    assert q.running() == 2


async def test_a_freed_slot_goes_to_interactive_before_older_batch() -> None:
    q = queue()
    running = await q.admit(BATCH)
    order: list[str] = []

    async def wait(priority: PriorityClass, name: str) -> Ticket:
        ticket = await q.admit(priority)
        order.append(name)
        return ticket

    batch = asyncio.create_task(wait(BATCH, "batch"))
    await settle()
    interactive = asyncio.create_task(wait(INTERACTIVE, "interactive"))
    await settle()
    assert q.waiting(BATCH) == 1 and q.waiting(INTERACTIVE) == 1
    q.release(running)
    q.release(await interactive)
    await batch
    assert order == ["interactive", "batch"]


async def test_batch_share_keeps_slots_for_interactive() -> None:
    q = queue(max_in_flight=3, batch_max=2)
    await q.admit(BATCH)
    await q.admit(BATCH)
    third_batch = asyncio.create_task(q.admit(BATCH))
    await settle()
    assert not third_batch.done()
    interactive = await asyncio.wait_for(q.admit(INTERACTIVE), 1.0)
    assert interactive.queued_s == 0
    third_batch.cancel()


async def test_a_full_class_queue_sheds_with_retry_after() -> None:
    q = queue(bq=1)
    ticket = await q.admit(BATCH)
    waiting = asyncio.create_task(q.admit(BATCH))
    await settle()
    with pytest.raises(ResourceExhausted) as raised:
        await q.admit(BATCH)
    assert raised.value.retry_after_s is not None and raised.value.retry_after_s > 0
    assert "batch queue is full" in str(raised.value)
    # The interactive queue is separate.
    interactive = asyncio.create_task(q.admit(INTERACTIVE))
    await settle()
    q.release(ticket)
    q.release(await interactive)
    q.release(await waiting)


async def test_expected_wait_beyond_the_deadline_sheds_at_once() -> None:
    q = queue()
    ticket = await q.admit(INTERACTIVE)
    await asyncio.sleep(0.05)
    q.release(ticket)  # teaches the queue that a request holds its slot ~50 ms
    await q.admit(INTERACTIVE)
    started = time.monotonic()
    with pytest.raises(ResourceExhausted) as raised:
        await q.admit(INTERACTIVE, deadline=time.monotonic() + 0.01)
    assert time.monotonic() - started < 0.01
    assert "exceeds the request's deadline" in str(raised.value)
    assert raised.value.retry_after_s == pytest.approx(0.05, rel=0.5)


async def test_a_waiter_whose_deadline_passes_gives_up_cleanly() -> None:
    q = queue()
    ticket = await q.admit(INTERACTIVE)
    with pytest.raises(DeadlineExceeded):
        await q.admit(INTERACTIVE, deadline=time.monotonic() + 0.05)
    assert q.waiting(INTERACTIVE) == 0
    q.release(ticket)
    assert q.running() == 0
    assert (await asyncio.wait_for(q.admit(INTERACTIVE), 1.0)).queued_s == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_never_holds_a_slot() -> None:
    q = queue()
    ticket = await q.admit(INTERACTIVE)
    waiter = asyncio.create_task(q.admit(INTERACTIVE))
    await settle()
    q.release(ticket)  # grants the slot to the waiter...
    waiter.cancel()  # ...which is cancelled before it runs: the slot must come back
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert q.running() == 0
    await asyncio.wait_for(q.admit(INTERACTIVE), 1.0)


async def test_release_is_idempotent() -> None:
    q = queue(max_in_flight=2, batch_max=2)
    ticket = await q.admit(INTERACTIVE)
    q.release(ticket)
    q.release(ticket)
    assert q.running() == 0


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        QueueLimits(0, 0, 1, 1)
    with pytest.raises(ValueError):
        QueueLimits(2, 3, 1, 1)
