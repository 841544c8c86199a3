"""Background work whose outcome is always retrieved (kvmesh/background.py), and
run_unless_cancelled's abandoned work: never "Task exception was never retrieved"."""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import pytest

from kvmesh.background import Background, stop_loop
from kvmesh.errors import DeadlineExceeded, Unavailable
from kvmesh.streams import run_unless_cancelled


def _watch_loop() -> list[dict[str, Any]]:
    """What the running loop's exception handler gets ("Task exception was never retrieved"
    among it); the handler goes with the test's loop."""
    seen: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: seen.append(context))
    return seen


async def _fails(error: Exception, go: asyncio.Event | None = None) -> None:
    if go is not None:
        await go.wait()
    raise error


def _collected(seen: list[dict[str, Any]]) -> list[str]:
    gc.collect()
    return [str(context.get("message")) for context in seen]


async def test_an_ordinary_failure_is_one_line_at_its_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    unretrieved = _watch_loop()
    background = Background()
    caplog.set_level(logging.DEBUG, logger="kvmesh.background")
    background.spawn(_fails(Unavailable("the worker went away")), "ReleaseKv on w0")
    background.spawn(_fails(DeadlineExceeded("too late")), "a check", logging.DEBUG)
    await background.wait(1.0)
    await asyncio.sleep(0)  # the done callbacks run
    records = [(r.levelno, r.getMessage(), r.exc_info) for r in caplog.records]
    assert records == [
        (logging.INFO, "ReleaseKv on w0: UNAVAILABLE: the worker went away", None),
        (logging.DEBUG, "a check: DEADLINE_EXCEEDED: too late", None),
    ]
    assert _collected(unretrieved) == []


async def test_an_unexpected_failure_still_surfaces_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    unretrieved = _watch_loop()
    background = Background()
    background.spawn(_fails(ValueError("a bug")), "ReleaseKv on w0")
    await background.wait(1.0)
    await asyncio.sleep(0)
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert record.getMessage() == "ReleaseKv on w0 failed"
    assert record.exc_info is not None and isinstance(record.exc_info[1], ValueError)
    assert _collected(unretrieved) == []


async def test_work_failing_as_its_caller_is_cancelled_is_retrieved() -> None:
    """The router's deadline and its caller's pass at once: the stream read fails with
    DeadlineExceeded in the same loop turn as grpc cancels the handler awaiting it."""
    unretrieved = _watch_loop()
    go = asyncio.Event()
    caller = asyncio.create_task(
        run_unless_cancelled(_fails(DeadlineExceeded("too late"), go), asyncio.Event())
    )
    await asyncio.sleep(0)  # the caller waits on the work
    await asyncio.sleep(0)  # the work waits on go
    go.set()  # the work fails first in the next turn ...
    caller.cancel()  # ... and its caller is cancelled in the same turn
    with pytest.raises(asyncio.CancelledError):
        await caller
    del caller
    await asyncio.sleep(0)
    assert _collected(unretrieved) == []


async def test_a_loop_that_swallows_its_cancel_is_still_stopped() -> None:
    # As a loop does whose cancel Python 3.11's asyncio.wait_for lost: it runs on.
    rounds = 0

    async def stubborn() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if rounds > 2:
                    raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_loop(task, retry_s=0.01), timeout=5)
    assert task.cancelled() and rounds == 3


async def test_a_loop_that_failed_reports_its_error_when_stopped() -> None:
    async def broken() -> None:
        raise RuntimeError("sweep failed")

    task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="sweep failed"):
        await stop_loop(task)
