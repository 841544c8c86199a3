"""KV block copies off the engine thread, and the engine commands that must wait for them.

AsyncEngine copies blocks out of a held handle (exports) and into an import in progress on
worker threads, so that a copy does not wait for the engine's current step (a chunked prefill
can take a second). Both block sets are safe to copy while the engine steps: a held handle's
blocks no longer change, an import's pulled blocks are seen by nobody before its commit. The
command that ends such a set (release, cancel_import, commit_import) frees or publishes its
blocks, so it must not run while a copy of them is in flight: BlockCopies counts the copies of
each set and defers those commands until the last one ends.

Everything here runs on the event loop's thread, except the copies themselves.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class _BlockSet:
    owner: object
    block_ids: list[int]
    in_flight: int = 0
    closed: bool = False
    # Run once the set is closed and no copy is in flight.
    when_idle: list[Callable[[], None]] = field(default_factory=list)


class BlockCopies:
    """Open block sets by key (a handle id, or an import's request id) and their copies.

    `owner` tells a set from a later one under the same key (an import's plan: a request id
    is reused once its import ended); None when keys are never reused.
    """

    def __init__(self) -> None:
        self._sets: dict[str, _BlockSet] = {}

    def open(self, key: str, block_ids: list[int], owner: object = None) -> None:
        """Start tracking a set whose blocks may now be copied."""
        # The engine refuses a second handle or import under a live key, and a closed set
        # leaves here before the engine command that ends it is queued.
        assert key not in self._sets, f"block set {key!r} is already open"
        self._sets[key] = _BlockSet(owner, list(block_ids))

    def block_ids(self, key: str, owner: object = None) -> list[int] | None:
        """The set's blocks; None when it is unknown, or closed (being released or ended)."""
        block_set = self._find(key, owner)
        return None if block_set is None or block_set.closed else block_set.block_ids

    async def copy(self, key: str, executor: Executor, fn: Callable[[], T]) -> T:
        """Run fn on one of executor's threads, counted against the open set `key` until it returns.

        The count ends when fn does, not when the caller stops waiting: a cancelled caller
        cannot cancel a copy that is already running.
        """
        block_set = self._sets[key]
        assert not block_set.closed, f"block set {key!r} is closed"
        block_set.in_flight += 1
        future = asyncio.get_running_loop().run_in_executor(executor, fn)
        future.add_done_callback(functools.partial(self._copy_done, key, block_set))
        return await asyncio.shield(future)

    def close(self, key: str, then: Callable[[], None], owner: object = None) -> None:
        """Refuse new copies of the set and call `then` once none is in flight: at once if
        none is, or if the set is unknown here (so nothing of it can be in flight)."""
        block_set = self._find(key, owner)
        if block_set is None:
            then()
            return
        block_set.closed = True
        block_set.when_idle.append(then)
        self._finish_if_idle(key, block_set)

    def __len__(self) -> int:
        return len(self._sets)

    def _find(self, key: str, owner: object) -> _BlockSet | None:
        block_set = self._sets.get(key)
        return block_set if block_set is not None and block_set.owner is owner else None

    def _copy_done(self, key: str, block_set: _BlockSet, future: asyncio.Future[object]) -> None:
        if not future.cancelled():
            future.exception()  # retrieved here: the caller may have stopped waiting
        block_set.in_flight -= 1
        self._finish_if_idle(key, block_set)

    def _finish_if_idle(self, key: str, block_set: _BlockSet) -> None:
        if not block_set.closed or block_set.in_flight:
            return
        if self._sets.get(key) is block_set:
            del self._sets[key]
        callbacks, block_set.when_idle = block_set.when_idle, []
        for callback in callbacks:
            callback()
