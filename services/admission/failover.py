"""Stores shared through Redis, with a local stand-in while Redis is unreachable.

The gateway fails open: when the shared store cannot be reached, each replica counts on its
own (and so enforces a tenant's limits alone) rather than refusing every request. The outage
is logged once, counted on every failed call, and its end is logged too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Generic, Protocol, TypeVar

from redis.exceptions import RedisError

from services.admission import metrics

log = logging.getLogger(__name__)

T = TypeVar("T")


class StoreDown(Exception):
    """The shared store could not be reached."""


class NamedStore(Protocol):
    name: str
    """How logs name the store ("redis", "memory")."""


S = TypeVar("S", bound=NamedStore)


@contextlib.contextmanager
def redis_calls() -> Iterator[None]:
    """Turns a failed Redis call (down, timed out) into StoreDown."""
    try:
        yield
    except RedisError as error:
        raise StoreDown(str(error)) from error


RETRY_S = 0.2
"""While the shared store is down, how long calls go straight to the fallback before the
store is tried again (a hung Redis would otherwise cost every call its socket timeout)."""


class Failover(Generic[S]):
    """Runs operations on a shared store, or on a local fallback while the shared one is down.

    The outage is logged once when it starts and once when it ends. When the store answers
    again, `on_recovery` (if given) runs before the first operation that finds it back: the
    owner moves what it counted locally meanwhile into the store, so that operation already
    counts against everything (a StoreDown from it means the store is still down)."""

    def __init__(
        self,
        store: S,
        fallback: S | None,
        *,
        role: str,
        on_recovery: Callable[[], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`role` says what the store keeps: the metrics.BACKEND_ERRORS label, named in logs."""
        self._store = store
        self._fallback = fallback
        self._role = role
        self._on_recovery = on_recovery
        self._clock = clock
        self._down = False
        self._retry_at = 0.0
        self._recovering = asyncio.Lock()
        self._prober: asyncio.Task[None] | None = None

    @property
    def down(self) -> bool:
        """The shared store failed its last call."""
        return self._down

    async def call(self, operation: Callable[[S], Awaitable[T]], default: T) -> tuple[S, T]:
        """The store that answered and its answer; `default` when neither could answer."""
        if self._down and self._clock() < self._retry_at:
            return await self._fall_back(operation, default)
        try:
            if self._down:
                await self._recover()
            result = await operation(self._store)
        except StoreDown as error:
            self.failed(error)
            return await self._fall_back(operation, default)
        return self._store, result

    async def _recover(self) -> None:
        async with self._recovering:  # one recovery at a time: nothing merged twice
            if not self._down:
                return
            if self._on_recovery is not None:
                await self._on_recovery()
            self._down = False
            log.info("%s store %s reachable again", self._role, self._store.name)

    def probe_while(self, pending: Callable[[], bool]) -> None:
        """While the store is down and `pending()` (the owner holds local counts that the
        store must get back), tries to recover every RETRY_S without waiting for a call:
        the shared limits are exact again within RETRY_S of the store's return."""
        if self._prober is None or self._prober.done():
            self._prober = asyncio.ensure_future(self._probe(pending))

    async def _probe(self, pending: Callable[[], bool]) -> None:
        while self._down and pending():
            await asyncio.sleep(RETRY_S)
            try:
                await self._recover()
            except StoreDown as error:
                self.failed(error)

    async def close(self) -> None:
        """Stops probing."""
        if self._prober is not None:
            self._prober.cancel()
            await asyncio.gather(self._prober, return_exceptions=True)

    def failed(self, error: StoreDown) -> None:
        """Counts a failed call of the store; logs the outage on its first one."""
        metrics.BACKEND_ERRORS.labels(self._role).inc()
        if not self._down:
            log.warning(
                "%s store %s unreachable (%s): counting locally until it answers",
                self._role,
                self._store.name,
                error,
            )
        self._down = True
        self._retry_at = self._clock() + RETRY_S

    async def _fall_back(self, operation: Callable[[S], Awaitable[T]], default: T) -> tuple[S, T]:
        if self._fallback is None:
            return self._store, default
        return self._fallback, await operation(self._fallback)


class Retries:
    """Writes the shared store did not take (a slot release, a budget settle), tried again
    every RETRY_S until each lands or stops mattering (its lease or window has ended)."""

    def __init__(self, what: str) -> None:
        """`what` names the writes in the log line of one that landed late."""
        self._what = what
        self._pending: dict[int, tuple[Callable[[], Awaitable[None]], float]] = {}
        self._numbers = itertools.count()
        self._task: asyncio.Task[None] | None = None

    def add(self, write: Callable[[], Awaitable[None]], until: float) -> None:
        """Retries `write` until it lands or time.monotonic() passes `until`."""
        self._pending[next(self._numbers)] = (write, until)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._retry())

    def __len__(self) -> int:
        return len(self._pending)

    async def _retry(self) -> None:
        while self._pending:
            await asyncio.sleep(RETRY_S)
            landed = 0
            for key, (write, until) in list(self._pending.items()):
                if time.monotonic() >= until:
                    del self._pending[key]  # ended on its own meanwhile
                    continue
                try:
                    await write()
                except StoreDown:
                    break  # still down: the next round tries again
                del self._pending[key]
                landed += 1
            if landed:
                log.info("%d %s that an outage had kept landed", landed, self._what)

    async def close(self) -> None:
        """Stops retrying (what is pending ends with its lease or window)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
