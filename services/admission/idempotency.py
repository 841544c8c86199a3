"""Idempotency keys: a repeated key returns the first request's result.

Results are kept per (tenant, key) for `ttl_s`, at most `capacity` of them (the oldest go
first). A repeat that arrives while the first request still runs waits for it. When the first
request does not finish with a result (error, cancel), its key is freed and one waiting
repeat runs the request itself. A key reused with a different request is refused.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvmesh.errors import InvalidArgument

T = TypeVar("T")


@dataclass(slots=True)
class _Entry(Generic[T]):
    fingerprint: bytes
    done: asyncio.Future[T | None]
    """Resolves to the result, or to None when the owner gave up."""
    expires_at: float = field(default=float("inf"))


@dataclass(slots=True, frozen=True)
class Claim(Generic[T]):
    """The right (and duty) to run a keyed request: end it with `finish` or `abandon`."""

    scope: tuple[str, str]
    entry: _Entry[T]


class IdempotencyStore(Generic[T]):
    """Bounded map of (tenant, key) -> first result."""

    def __init__(
        self, capacity: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], _Entry[T]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def claim(self, tenant: str, key: str, fingerprint: bytes) -> T | Claim[T]:
        """The stored result for the key, or a Claim when this caller must run the request."""
        scope = (tenant, key)
        while True:
            entry = self._entries.get(scope)
            if entry is not None and entry.expires_at <= self._clock():
                del self._entries[scope]
                entry = None
            if entry is None:
                entry = _Entry(fingerprint, asyncio.get_running_loop().create_future())
                self._entries[scope] = entry
                self._evict()
                return Claim(scope, entry)
            if entry.fingerprint != fingerprint:
                raise InvalidArgument(
                    "idempotency_key", "this key was already used for a different request"
                )
            result = await asyncio.shield(entry.done)
            if result is not None:
                return result

    def finish(self, claim: Claim[T], result: T) -> None:
        """Stores the result for repeats of the key."""
        entry = claim.entry
        if entry.done.done():
            return
        entry.expires_at = self._clock() + self._ttl_s
        entry.done.set_result(result)
        if self._entries.get(claim.scope) is entry:
            self._entries.move_to_end(claim.scope)

    def abandon(self, claim: Claim[T]) -> None:
        """Frees the key without a result; a waiting repeat will run the request."""
        entry = claim.entry
        if self._entries.get(claim.scope) is entry:
            del self._entries[claim.scope]
        if not entry.done.done():
            entry.done.set_result(None)

    def _evict(self) -> None:
        """Drops the oldest finished entries past capacity (running ones are never dropped)."""
        excess = len(self._entries) - self._capacity
        for scope in list(self._entries):
            if excess <= 0:
                return
            if self._entries[scope].done.done():
                del self._entries[scope]
                excess -= 1
