"""BlockCopies: copies counted per block set, and the commands that wait for them (no model)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.worker.engine.block_copies import BlockCopies
from tests.thread_gate import Gate


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as pool:
        yield pool


def boom() -> None:
    raise ValueError("copy failed")


async def test_close_waits_for_every_copy_even_failed_or_abandoned(
    executor: ThreadPoolExecutor,
) -> None:
    copies = BlockCopies()
    copies.open("h", [4, 5])
    assert copies.block_ids("h") == [4, 5]
    gate = Gate()
    held = asyncio.create_task(copies.copy("h", executor, gate.wrap(lambda: "read")))
    await gate.wait_entered()
    with pytest.raises(ValueError, match="copy failed"):
        await copies.copy("h", executor, boom)
    held.cancel()  # the caller stops waiting; the copy itself runs on
    ended: list[str] = []
    copies.close("h", lambda: ended.append("release"))
    copies.close("h", lambda: ended.append("again"))
    assert copies.block_ids("h") is None  # closed: no new copies
    await asyncio.sleep(0.05)
    assert ended == [] and len(copies) == 1
    gate.opened.set()
    with pytest.raises(asyncio.CancelledError):
        await held
    for _ in range(100):
        if ended:
            break
        await asyncio.sleep(0.01)
    assert ended == ["release", "again"]
    assert len(copies) == 0


async def test_unknown_or_other_owner_ends_at_once() -> None:
    copies = BlockCopies()
    plan, later_plan = object(), object()
    copies.open("r", [1], owner=plan)
    assert copies.block_ids("r", later_plan) is None
    ended: list[str] = []
    copies.close("r", lambda: ended.append("stale"), later_plan)
    copies.close("unknown", lambda: ended.append("unknown"))
    assert ended == ["stale", "unknown"]
    assert copies.block_ids("r", plan) == [1]  # the live set is untouched
    copies.close("r", lambda: ended.append("live"), plan)
    assert ended[-1] == "live" and len(copies) == 0
