"""KV leases: a prefill worker holds a request's blocks until they are pulled, released or expire.

`LeaseTable` is the bookkeeping (ids, TTLs, expiry, who may use a lease) and knows nothing of
the engine. The TTL is the worker's: a caller may ask for a shorter one, never a longer one, so
nobody pins blocks for longer than the worker allows. A lease is used (pulled, released) only
by the mesh members it was granted for;
`LeaseSweeper` runs in the background and hands every expired lease to a release callback, so
blocks nobody pulls or releases go back to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvmesh.background import stop_loop
from kvmesh.errors import NotFound, PermissionDenied

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Release = Callable[["LeaseRecord"], Awaitable[None]]


@dataclass(slots=True)
class LeaseRecord:
    """The worker's record of one lease (a KvLease on the wire) on the blocks the engine holds
    under one KvHandle."""

    lease_id: str
    """Opaque, unguessable id the lease is named by on the wire."""
    handle_id: str
    """The engine's KvHandle id that pins the blocks."""
    block_hashes: list[bytes]
    """Chained hashes of the leased blocks, in order."""
    num_tokens: int
    """Tokens whose KV the blocks hold."""
    expires_at: float
    """Monotonic time after which the lease is void."""
    expires_unix_ms: int
    """The same instant as Unix milliseconds, for the wire."""
    holders: frozenset[str]
    """Mesh names of the members that may pull or release it (the caller that asked for it
    and the puller it named)."""


@dataclass(slots=True)
class LeaseTable:
    """Active leases by id, with their expiry times."""

    ttl_s: float
    """The TTL of every lease, and the longest a caller may ask for."""
    clock: Clock = time.monotonic
    wall_clock: Clock = time.time
    _leases: dict[str, LeaseRecord] = field(default_factory=dict)

    def grant(
        self,
        handle_id: str,
        block_hashes: list[bytes],
        num_tokens: int,
        holders: frozenset[str],
        ttl_s: float | None = None,
    ) -> LeaseRecord:
        """A new lease on a handle for `holders`, valid for `ttl_s` when that is shorter than
        the table's TTL (the table's TTL when None or 0)."""
        ttl = min(ttl_s, self.ttl_s) if ttl_s else self.ttl_s
        lease = LeaseRecord(
            lease_id=secrets.token_hex(16),
            handle_id=handle_id,
            block_hashes=list(block_hashes),
            num_tokens=num_tokens,
            expires_at=self.clock() + ttl,
            expires_unix_ms=int((self.wall_clock() + ttl) * 1000),
            holders=holders,
        )
        self._leases[lease.lease_id] = lease
        return lease

    def get(self, lease_id: str, caller: str) -> LeaseRecord:
        """The live lease, used by `caller` (a mesh name); NotFound when unknown, released or
        past its expiry, PermissionDenied when it was not granted for `caller`."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.expires_at <= self.clock():
            raise NotFound(f"KV lease {lease_id!r} is unknown or has expired")
        if caller not in lease.holders:
            raise PermissionDenied(
                f"KV lease {lease_id!r} was not granted for {caller or 'an anonymous caller'!r}"
            )
        return lease

    def take(self, lease_id: str, caller: str) -> LeaseRecord:
        """Removes and returns the live lease (to release it); errors as `get`."""
        lease = self.get(lease_id, caller)
        del self._leases[lease_id]
        return lease

    def drop(self, lease_id: str) -> LeaseRecord | None:
        """Removes and returns the lease whatever its holders (the worker's own clean-up)."""
        return self._leases.pop(lease_id, None)

    def take_expired(self) -> list[LeaseRecord]:
        """Removes and returns every lease past its expiry."""
        now = self.clock()
        expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in expired:
            del self._leases[lease.lease_id]
        return expired

    def take_all(self) -> list[LeaseRecord]:
        """Removes and returns every lease (at shutdown)."""
        leases = list(self._leases.values())
        self._leases.clear()
        return leases

    def __len__(self) -> int:
        return len(self._leases)


@dataclass(slots=True)
class LeaseSweeper:
    """Every `interval_s`, releases the leases that expired and runs the `also` hook.

    The hook lets the worker refresh its gauges on the same beat without a second loop.
    """

    table: LeaseTable
    release: Release
    interval_s: float
    also: Callable[[], None] | None = None
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts the background loop."""
        self._task = asyncio.create_task(self._run())

    async def sweep(self) -> int:
        """Releases the expired leases now; returns how many there were."""
        expired = self.table.take_expired()
        for lease in expired:
            log.info(
                "KV lease %s expired: releasing %d blocks", lease.lease_id, len(lease.block_hashes)
            )
            try:
                await self.release(lease)
            except Exception:  # one bad release must not stop the sweeper
                log.exception("releasing expired lease %s failed", lease.lease_id)
        return len(expired)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.sweep()
            if self.also is not None:
                try:
                    self.also()
                except Exception:  # a failing hook must not stop the sweeper
                    log.exception("lease sweeper hook failed")

    async def stop(self) -> None:
        """Stops the loop."""
        if self._task is not None:
            await stop_loop(self._task)
