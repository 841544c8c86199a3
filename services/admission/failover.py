"""Stores shared through Redis, with a local stand-in while Redis is unreachable.

The gateway fails open: when the shared store cannot be reached, each replica counts on its
own (and so enforces a tenant's limits alone) rather than refusing every request. The outage
is logged once, counted on every failed call, and its end is logged too.
"""

from __future__ import annotations

import contextlib
import logging
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


class Failover(Generic[S]):
    """Runs operations on a shared store, or on a local fallback while the shared one is down."""

    def __init__(self, store: S, fallback: S | None, *, role: str) -> None:
        """`role` says what the store keeps: the metrics.BACKEND_ERRORS label, named in logs."""
        self._store = store
        self._fallback = fallback
        self._role = role
        self._down = False

    async def call(self, operation: Callable[[S], Awaitable[T]], default: T) -> tuple[S, T]:
        """The store that answered and its answer; `default` when neither could answer."""
        try:
            result = await operation(self._store)
        except StoreDown as error:
            metrics.BACKEND_ERRORS.labels(self._role).inc()
            if not self._down:
                log.warning(
                    "%s store %s unreachable (%s): counting locally",
                    self._role,
                    self._store.name,
                    error,
                )
            self._down = True
            if self._fallback is None:
                return self._store, default
            return self._fallback, await operation(self._fallback)
        if self._down:
            log.info("%s store %s reachable again", self._role, self._store.name)
            self._down = False
        return self._store, result
