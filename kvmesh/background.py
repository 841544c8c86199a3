"""Background work whose outcome is always retrieved: no "Task exception was never retrieved".

A task nobody awaits (a lease release, a health check, a stream read abandoned by a caller
that went away) still ends somehow. An ordinary ending (cancelled, or a KvmeshError: a
deadline, a worker gone) is logged at `ordinary_level` in one line naming the work; anything
else is a bug and is logged at ERROR with its traceback. Nothing here imports gRPC.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvmesh.errors import KvmeshError

log = logging.getLogger(__name__)

T = TypeVar("T")


def reap(task: asyncio.Future[T], what: str, ordinary_level: int = logging.INFO) -> None:
    """Retrieves `task`'s outcome once it ends, logging a failure (see the module docstring).

    For a task whose result nobody will ask for; one that is awaited reports its own error."""

    def retrieve(done: asyncio.Future[T]) -> None:
        if done.cancelled():
            return
        error = done.exception()
        if error is None:
            return
        if isinstance(error, KvmeshError):
            log.log(ordinary_level, "%s: %s: %s", what, error.status, error.message)
        else:
            log.error("%s failed", what, exc_info=error)

    task.add_done_callback(retrieve)


async def stop_loop(task: asyncio.Task[Any], retry_s: float = 1.0) -> None:
    """Cancels a background loop and waits until it has ended; an error it ended with (other
    than the cancel) is raised here. The cancel is sent again every `retry_s` while the task
    runs on: Python 3.11's asyncio.wait_for can swallow a cancel that lands as the awaitable
    it wraps completes (dnspython's queries wait that way), and a loop that lost its cancel
    kept its stopper waiting for good (the router's DNS discovery: a teardown of 120 s)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=retry_s)
    if not task.cancelled():
        task.result()


class Background:
    """Fire-and-forget tasks, held until they end (the loop keeps only weak references) and
    reaped (see `reap`)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(
        self, work: Coroutine[Any, Any, T], what: str, ordinary_level: int = logging.INFO
    ) -> asyncio.Task[T]:
        """Runs `work` in the background; `what` names it in the log line of a failure."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        reap(task, what, ordinary_level)
        return task

    async def wait(self, timeout_s: float) -> None:
        """Waits at most `timeout_s` for the running tasks (at shutdown)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
