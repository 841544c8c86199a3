"""Holdings: whatever a request was granted is given back once, wherever a cancel lands."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

import pytest

from kvmesh.streams import run_unless_cancelled
from kvmesh.tenants import PriorityClass
from services.admission.admission_queue import AdmissionQueue, QueueLimits
from services.admission.holdings import Holdings

INTERACTIVE = PriorityClass.INTERACTIVE


def spawn(coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    return asyncio.ensure_future(coroutine)


async def ticks(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def take_slot(queue: AdmissionQueue, holdings: Holdings, cancelled: asyncio.Event) -> object:
    """A request's wait for its queue slot; its coroutines are made only once its task runs
    (a task cancelled before its first step would leave them never awaited)."""
    take = holdings.take(queue.admit(INTERACTIVE), queue.release, interruptible=True)
    return await run_unless_cancelled(take, cancelled)


@pytest.mark.parametrize("by_event", [False, True])
async def test_a_queue_slot_granted_around_a_cancel_is_given_back(by_event: bool) -> None:
    """The slot frees up `before` loop turns after the waiter starts and the waiter is
    cancelled `after` turns later: every interleaving of grant and cancel ends with the
    queue empty and its one slot free."""
    queue = AdmissionQueue(QueueLimits(1, 1, 8, 8))
    for before in range(6):
        for after in range(6):
            holder = await queue.admit(INTERACTIVE)
            holdings = Holdings(spawn)
            cancelled = asyncio.Event()
            waiter = asyncio.ensure_future(take_slot(queue, holdings, cancelled))
            await ticks(before)
            queue.release(holder)
            await ticks(after)
            if by_event:
                cancelled.set()
            else:
                waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
            await holdings.release_all()
            await ticks(6)
            assert (queue.running(), queue.waiting(INTERACTIVE)) == (0, 0), (before, after)


async def test_a_grant_that_lands_after_the_request_ended_is_released_on_arrival() -> None:
    released: list[str] = []
    gate = asyncio.Event()

    async def slow_grant() -> str:
        await gate.wait()
        return "slot"

    async def release(value: str) -> None:
        released.append(value)

    holdings = Holdings(spawn)
    taking = asyncio.ensure_future(holdings.take(slow_grant(), release, interruptible=False))
    await ticks(2)
    taking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await taking
    await holdings.release_all()
    assert released == []
    gate.set()
    await ticks(4)
    assert released == ["slot"]
    await holdings.release_all()
    assert released == ["slot"], "released twice"
