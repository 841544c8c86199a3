"""Stores shared through Redis, with a local stand-in while Redis is unreachable.

The gateway fails open: when the shared store cannot be reached, each replica counts on its
own (and so enforces a tenant's limits alone) rather than refusing every request. The outage
is logged once, counted on every failed call, and its end is logged too.
"""

from __future__ import annotations

import contextlib
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

    The outage is logged once when it starts and once when it ends; `on_recovery` (if given)
    runs when the store answers again, before that call returns: the owner merges what it
    counted locally meanwhile."""

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

    @property
    def down(self) -> bool:
        """The shared store failed its last call."""
        return self._down

    async def call(self, operation: Callable[[S], Awaitable[T]], default: T) -> tuple[S, T]:
        """The store that answered and its answer; `default` when neither could answer."""
        if self._down and self._clock() < self._retry_at:
            return await self._fall_back(operation, default)
        try:
            result = await operation(self._store)
        except StoreDown as error:
            self.failed(error)
            return await self._fall_back(operation, default)
        if self._down:
            self._down = False
            log.info("%s store %s reachable again", self._role, self._store.name)
            if self._on_recovery is not None:
                await self._on_recovery()
        return self._store, result

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
