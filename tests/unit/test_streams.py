"""Bidi stream helpers: first message, cancel watch, coalescing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.streams import CancelWatch, Coalescer, first_message, run_unless_cancelled


async def _items(values: list[str], gate: asyncio.Event | None = None) -> AsyncIterator[str]:
    for value in values:
        if gate is not None:
            await gate.wait()
        yield value


async def test_first_message_of_an_empty_stream_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="before its first message"):
        await first_message(_items([]), "request")
    assert await first_message(_items(["a", "b"]), "request") == "a"


async def test_coalescer_batches_what_a_slow_consumer_missed() -> None:
    produced = asyncio.Queue[str]()

    async def source() -> AsyncIterator[str]:
        while (item := await produced.get()) != "end":
            yield item

    batches = Coalescer(source())
    produced.put_nowait("a")
    assert await anext(batches) == ["a"]  # a fast consumer gets single items
    for item in ("b", "c", "d"):
        produced.put_nowait(item)
    await asyncio.sleep(0.01)  # the consumer is busy while three items arrive
    assert await anext(batches) == ["b", "c", "d"]
    produced.put_nowait("e")
    produced.put_nowait("end")
    await asyncio.sleep(0.01)
    assert await anext(batches) == ["e"]
    assert await anext(batches, None) is None


async def test_coalescer_delivers_items_before_the_error() -> None:
    async def source() -> AsyncIterator[int]:
        yield 1
        yield 2
        raise ValueError("boom")

    batches = Coalescer(source())
    await asyncio.sleep(0.01)
    assert await anext(batches) == [1, 2]
    with pytest.raises(ValueError, match="boom"):
        await anext(batches)


async def test_coalescer_starts_and_closes_the_source() -> None:
    events: list[str] = []

    async def source() -> AsyncIterator[int]:
        events.append("started")
        try:
            await asyncio.Event().wait()
            yield 1
        finally:
            events.append("closed")

    batches = Coalescer(source())
    await asyncio.sleep(0.01)
    assert events == ["started"]  # runs before anyone asks for a batch
    await batches.aclose()
    assert events == ["started", "closed"]
    assert await anext(batches, None) is None


async def test_coalescer_interrupt_wakes_a_waiting_consumer_and_stays() -> None:
    never = asyncio.Event()
    batches = Coalescer(_items(["a", "b"], gate=never))
    waiting = asyncio.ensure_future(anext(batches, None))
    await asyncio.sleep(0)
    assert not waiting.done()
    batches.interrupt()
    assert await asyncio.wait_for(waiting, 1.0) is None
    assert batches.interrupted
    never.set()  # what the source makes after the interrupt is never delivered
    await asyncio.sleep(0.01)
    assert await anext(batches, None) is None
    await batches.aclose()


async def test_coalescer_interrupt_when_an_event_is_set() -> None:
    cancelled, gate = asyncio.Event(), asyncio.Event()

    async def source() -> AsyncIterator[str]:
        for value in ["a", "b", "c"]:
            await gate.wait()
            gate.clear()
            yield value

    batches = Coalescer(source())
    batches.interrupt_when(cancelled)
    gate.set()
    assert await anext(batches) == ["a"]
    cancelled.set()
    assert await asyncio.wait_for(anext(batches, None), 1.0) is None
    assert batches.interrupted
    gate.set()
    await asyncio.sleep(0.01)
    assert await anext(batches, None) is None  # "b", made after the interrupt, never comes
    await batches.aclose()


async def test_coalescer_ends_at_the_source_end_without_interrupt() -> None:
    batches = Coalescer(_items(["a"]))
    batches.interrupt_when(asyncio.Event())
    assert await anext(batches) == ["a"]
    assert await anext(batches, None) is None
    assert not batches.interrupted
    await batches.aclose()


async def test_coalescer_reports_the_drain_over_once_whether_the_source_ran_or_not() -> None:
    calls: list[str] = []
    ended = Coalescer(_items(["a"]))
    ended.when_drained(lambda: calls.append("ended"))
    assert await anext(ended) == ["a"]
    assert await anext(ended, None) is None
    await asyncio.sleep(0)
    assert calls == ["ended"]
    await ended.aclose()

    never_ran = Coalescer(_items(["b"]))  # closed before its drain task took a step
    never_ran.when_drained(lambda: calls.append("closed"))
    await never_ran.aclose()
    await asyncio.sleep(0)
    assert calls == ["ended", "closed"]


async def test_cancel_watch_sees_cancel_not_half_close() -> None:
    watch = CancelWatch(_items(["x", "cancel:stop"]), _reason, "r1")
    watch.start()
    await asyncio.wait_for(watch.cancelled.wait(), 1.0)
    assert watch.reason == "stop"
    await watch.close()

    quiet = CancelWatch(_items(["x"]), _reason, "r2")
    quiet.start()
    await asyncio.sleep(0.01)
    assert not quiet.cancelled.is_set()
    await quiet.close()


def _reason(message: str) -> str | None:
    return message.removeprefix("cancel:") if message.startswith("cancel:") else None


async def test_run_unless_cancelled() -> None:
    cancelled = asyncio.Event()
    assert await run_unless_cancelled(asyncio.sleep(0, result=5), cancelled) == 5
    gate = asyncio.Event()
    task = asyncio.ensure_future(run_unless_cancelled(gate.wait(), cancelled))
    await asyncio.sleep(0.01)
    cancelled.set()
    assert await task is None
