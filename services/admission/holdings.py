"""What one request holds while it runs, given back exactly once on every path.

A request takes a tenant slot, a budget reservation and an admission-queue slot. A cancel
(the client cutting the call) can land at any await: while Redis is granting a slot, after
the queue granted one but before the request saw it, or while something is being given back.
So the request does not own these itself. Each acquisition runs as a task of its own whose
done-callback hands whatever it granted to the request's Holdings, whether or not anyone is
still waiting for it; `release_all` (from a `finally`) gives everything back, in reverse order,
on a task of its own that a second cancel of the request cannot interrupt.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

Release = Callable[[T], Awaitable[None] | None]
Spawn = Callable[[Coroutine[Any, Any, None]], asyncio.Future[None]]
"""Runs a coroutine on a task the owner keeps track of (and waits for when it stops)."""


@dataclass(slots=True, eq=False)
class _Held(Generic[T]):
    value: T
    release: Release[T]
    released: bool = field(default=False)


class Holdings:
    """The slots and reservations of one request; see the module docstring."""

    def __init__(self, spawn: Spawn) -> None:
        self._spawn = spawn
        self._held: list[_Held[Any]] = []
        self._closed = False

    async def take(self, acquire: Awaitable[T], release: Release[T], *, interruptible: bool) -> T:
        """Awaits `acquire` and holds what it grants until released (an acquisition that
        grants nothing raises).

        `interruptible`: a cancel of the request cancels the acquisition (a queue wait, which
        gives back a slot it got meanwhile itself); otherwise the acquisition (a store call) is
        let finish, and what it granted is given back at once.
        """
        task = asyncio.ensure_future(acquire)
        task.add_done_callback(lambda done: self._keep(done, release))
        if not interruptible:
            return await asyncio.shield(task)
        try:
            return await task
        except asyncio.CancelledError:
            task.cancel()
            raise

    def _keep(self, done: asyncio.Future[T], release: Release[T]) -> None:
        if done.cancelled() or done.exception() is not None:
            return  # nothing granted; the exception reaches whoever awaits the task
        held = _Held(done.result(), release)
        self._held.append(held)
        if self._closed:  # granted after the request ended: nobody will use it
            self._spawn(self._release([held]))

    async def give_back(self, value: object) -> None:
        """Releases `value` now (idempotent), before the rest of what the request holds."""
        chosen = [h for h in self._held if h.value is value]
        await asyncio.shield(self._spawn(self._release(chosen)))

    async def release_all(self) -> None:
        """Releases everything still held, newest first; later grants are released on arrival.

        The releases run on a task of their own: a cancel of the caller's await leaves them
        running to the end."""
        self._closed = True
        await asyncio.shield(self._spawn(self._release(list(reversed(self._held)))))

    @staticmethod
    async def _release(held: list[_Held[Any]]) -> None:
        for item in held:
            if item.released:
                continue
            item.released = True
            try:
                outcome = item.release(item.value)
                if inspect.isawaitable(outcome):
                    await outcome
            except Exception:  # one failed release must not keep the others
                log.exception("releasing %r failed", item.value)
