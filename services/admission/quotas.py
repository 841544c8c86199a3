"""Token budgets per tenant: reserve before running, settle the real usage at the end.

A request reserves its worst case (prompt tokens + max_tokens) in two fixed windows, the
current minute and the current UTC day; the end of the request moves the counters to what it
really used (0 when it was aborted before running). Counters live in Redis when several
gateways must enforce one budget (atomic Lua: check-and-add in one step), in this process
otherwise. When Redis is unreachable the gateway falls back to its local counters rather
than refusing every request (services.admission.failover): each replica then enforces the
budget alone until Redis is back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from redis.asyncio import Redis

from kvmesh.errors import InvalidArgument, QuotaViolation, ResourceExhausted
from kvmesh.tenants import Tenant
from services.admission.failover import Failover, Retries, StoreDown, redis_calls

log = logging.getLogger(__name__)

MINUTE_S = 60
DAY_S = 86_400


@dataclass(slots=True, frozen=True)
class Window:
    """One counting window of one limit: which minute (or day) since the epoch."""

    kind: str
    """ "minute" or "day"."""
    index: int
    """Window number since the Unix epoch."""
    length_s: int
    """Window length in seconds."""
    limit: int
    """Tokens allowed in the window; 0 means unlimited."""

    def retry_after_s(self, now: float) -> float:
        """Seconds until this window ends and the next one starts empty."""
        return max((self.index + 1) * self.length_s - now, 0.001)

    def describe(self) -> str:
        return "tokens per minute" if self.kind == "minute" else "tokens per day"


def windows_for(tenant: Tenant, now: float) -> tuple[Window, Window]:
    """The tenant's current minute and day windows."""
    return (
        Window("minute", int(now // MINUTE_S), MINUTE_S, tenant.tokens_per_minute),
        Window("day", int(now // DAY_S), DAY_S, tenant.daily_tokens),
    )


@dataclass(slots=True, frozen=True)
class Rejection:
    """A reservation that did not fit: the window it broke and what was used in it."""

    window: Window
    used: int


class CounterStore(Protocol):
    """Token counters per (tenant, window); implementations must add atomically."""

    name: str

    async def try_add(
        self, tenant: str, windows: Sequence[Window], amount: int
    ) -> Rejection | None:
        """Adds `amount` to every window unless one would pass its limit (then adds nothing)."""
        ...

    async def adjust(self, tenant: str, windows: Sequence[Window], delta: int) -> None:
        """Adds `delta` (may be negative; counters stay >= 0) to windows still counted."""
        ...

    async def read(self, tenant: str, windows: Sequence[Window]) -> list[int]:
        """Tokens counted in each window."""
        ...


class MemoryCounters:
    """Counters in this process (one gateway, or the fallback while Redis is down)."""

    name = "memory"

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], tuple[int, int]] = {}
        """(tenant, kind) -> (window index, tokens): only the current window is kept."""

    def _get(self, tenant: str, window: Window) -> int:
        index, used = self._counts.get((tenant, window.kind), (window.index, 0))
        return used if index == window.index else 0

    async def try_add(
        self, tenant: str, windows: Sequence[Window], amount: int
    ) -> Rejection | None:
        for window in windows:
            used = self._get(tenant, window)
            if window.limit and used + amount > window.limit:
                return Rejection(window, used)
        for window in windows:
            self._counts[(tenant, window.kind)] = (window.index, self._get(tenant, window) + amount)
        return None

    async def adjust(self, tenant: str, windows: Sequence[Window], delta: int) -> None:
        for window in windows:
            index, used = self._counts.get((tenant, window.kind), (-1, 0))
            if index == window.index:
                self._counts[(tenant, window.kind)] = (index, max(used + delta, 0))

    async def read(self, tenant: str, windows: Sequence[Window]) -> list[int]:
        return [self._get(tenant, w) for w in windows]

    def merge(self, tenant: str, window: Window, tokens: int) -> None:
        """Adds tokens to a window's count unchecked (a merge that must wait)."""
        index, used = self._counts.get((tenant, window.kind), (window.index, 0))
        if index == window.index:  # a window that has passed meanwhile counts no more
            self._counts[(tenant, window.kind)] = (index, used + tokens)

    def holds_counts(self) -> bool:
        """Some tokens are counted here."""
        return any(used for _, used in self._counts.values())

    def drain(self) -> list[tuple[str, Window, int]]:
        """Every count kept here as (tenant, window, tokens), forgotten here."""
        lengths = {"minute": MINUTE_S, "day": DAY_S}
        counts = [
            (tenant, Window(kind, index, lengths[kind], 0), used)
            for (tenant, kind), (index, used) in self._counts.items()
            if used
        ]
        self._counts.clear()
        return counts


# KEYS: one counter per window. ARGV: amount, then (limit, ttl) per window.
_TRY_ADD = """
local amount = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  local limit = tonumber(ARGV[2 * i])
  local used = tonumber(redis.call('GET', key) or '0')
  if limit > 0 and used + amount > limit then
    return {i, used}
  end
end
for i, key in ipairs(KEYS) do
  redis.call('INCRBY', key, amount)
  redis.call('EXPIRE', key, tonumber(ARGV[2 * i + 1]))
end
return {0, 0}
"""

# KEYS: counters. ARGV: delta. Windows that already expired are left alone.
_ADJUST = """
local delta = tonumber(ARGV[1])
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    if redis.call('INCRBY', key, delta) < 0 then
      redis.call('SET', key, 0, 'KEEPTTL')
    end
  end
end
return 0
"""


class RedisCounters:
    """Counters in Redis, shared by every gateway using the same URL and prefix."""

    name = "redis"

    def __init__(self, client: Redis, prefix: str) -> None:
        self._client = client
        self._prefix = prefix
        self._try_add = client.register_script(_TRY_ADD)
        self._adjust = client.register_script(_ADJUST)

    def _key(self, tenant: str, window: Window) -> str:
        # The {tenant} hash tag keeps a tenant's counters in one cluster slot (one Lua call).
        return f"{self._prefix}quota:{{{tenant}}}:{window.kind}:{window.index}"

    async def try_add(
        self, tenant: str, windows: Sequence[Window], amount: int
    ) -> Rejection | None:
        args: list[int] = [amount]
        for window in windows:
            # A window's counter outlives it a little so a late settle still finds it.
            args += [window.limit, window.length_s + MINUTE_S]
        keys = [self._key(tenant, w) for w in windows]
        with redis_calls():
            broken, used = await self._try_add(keys=keys, args=args)
        return Rejection(windows[int(broken) - 1], int(used)) if int(broken) else None

    async def add(self, tenant: str, window: Window, amount: int) -> None:
        """Adds `amount` unchecked (creating the counter): counts made elsewhere, merged in."""
        with redis_calls():
            await self._try_add(
                keys=[self._key(tenant, window)], args=[amount, 0, window.length_s + MINUTE_S]
            )

    async def adjust(self, tenant: str, windows: Sequence[Window], delta: int) -> None:
        with redis_calls():
            await self._adjust(keys=[self._key(tenant, w) for w in windows], args=[delta])

    async def read(self, tenant: str, windows: Sequence[Window]) -> list[int]:
        with redis_calls():
            values = await self._client.mget([self._key(tenant, w) for w in windows])
        return [int(v) if v is not None else 0 for v in values]


@dataclass(slots=True)
class Reservation:
    """Tokens held for one request until it is settled."""

    tenant: str
    tokens: int
    windows: tuple[Window, ...]
    store: CounterStore
    settled: bool = field(default=False)


class Quotas:
    """Reserves, settles and reports tenants' token budgets."""

    def __init__(
        self,
        store: CounterStore,
        fallback: MemoryCounters | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._fallback = fallback
        self._stores = Failover[CounterStore](
            store, fallback, role="quotas", on_recovery=self._merge_local
        )
        self._clock = clock
        self._local: dict[int, Reservation] = {}
        """Reservations counted in the fallback and not settled yet, by id()."""
        self._settles = Retries("budget settles")

    async def _merge_local(self) -> None:
        """The store answers again: what was counted locally meanwhile is added to it (a
        Redis that came back empty then still holds the outage's usage), and reservations
        made meanwhile settle against it. A StoreDown on the way keeps what is not merged
        yet for the next recovery: nothing is counted twice or lost."""
        if self._fallback is None or not isinstance(self._store, RedisCounters):
            return
        counts = self._fallback.drain()
        merged = 0
        try:
            for tenant, window, tokens in counts:
                await self._store.add(tenant, window, tokens)
                merged += 1
        except StoreDown:
            for tenant, window, tokens in counts[merged:]:
                self._fallback.merge(tenant, window, tokens)
            raise
        for reservation in self._local.values():
            reservation.store = self._store
        self._local.clear()
        log.info("merged %d tokens counted during the outage", sum(c[2] for c in counts))

    async def reserve(self, tenant: Tenant, tokens: int) -> Reservation:
        """Holds `tokens` against the tenant's limits or raises ResourceExhausted."""
        now = self._clock()
        windows = windows_for(tenant, now)
        for window in windows:
            if window.limit and tokens > window.limit:
                raise InvalidArgument(
                    "sampling.max_tokens",
                    f"the request may use {tokens} tokens (prompt + max_tokens), more than "
                    f"tenant {tenant.name!r} may use in a whole window ({window.describe()}: "
                    f"{window.limit}); lower max_tokens",
                )
        store, rejection = await self._stores.call(
            lambda s: s.try_add(tenant.name, windows, tokens), default=None
        )
        if rejection is not None:
            raise _over_budget(tenant, rejection, tokens, now)
        reservation = Reservation(tenant.name, tokens, windows, store)
        if store is self._fallback:
            self._local[id(reservation)] = reservation
            # The counts made meanwhile reach the store when it returns, requests or not.
            self._stores.probe_while(lambda: bool(self._local) or self._fallback_counts())
        return reservation

    def _fallback_counts(self) -> bool:
        return self._fallback is not None and self._fallback.holds_counts()

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """Replaces the reserved amount with `used_tokens` (idempotent: only the first counts)."""
        if reservation.settled:
            return
        reservation.settled = True
        self._local.pop(id(reservation), None)
        delta = used_tokens - reservation.tokens
        if delta == 0:
            return
        store, tenant, windows = reservation.store, reservation.tenant, reservation.windows
        try:
            await store.adjust(tenant, windows, delta)
        except StoreDown as error:
            # Retried until it lands or its last window has ended (the reservation counts
            # meanwhile: errs toward the limit). Logged once per outage, with the outage.
            self._stores.failed(error)
            ends_in = max(w.retry_after_s(self._clock()) for w in windows)
            self._settles.add(
                lambda: store.adjust(tenant, windows, delta),
                until=time.monotonic() + ends_in,
            )

    async def release(self, reservation: Reservation) -> None:
        """Gives the whole reservation back (the request never ran)."""
        await self.settle(reservation, 0)

    async def close(self) -> None:
        """Stops retrying settles (what is pending ends with its window) and probing."""
        await self._settles.close()
        await self._stores.close()

    async def used(self, tenant: Tenant) -> tuple[int, int]:
        """Tokens counted this minute and today."""
        windows = windows_for(tenant, self._clock())
        _, counts = await self._stores.call(lambda s: s.read(tenant.name, windows), default=[0, 0])
        return counts[0], counts[1]


def _over_budget(
    tenant: Tenant, rejection: Rejection, tokens: int, now: float
) -> ResourceExhausted:
    window = rejection.window
    description = (
        f"{window.describe()}: {rejection.used} used + {tokens} requested > {window.limit}"
    )
    return ResourceExhausted(
        f"tenant {tenant.name!r} is over its budget ({description})",
        retry_after_s=window.retry_after_s(now),
        quota_violations=(QuotaViolation(f"tenant:{tenant.name}", description),),
    )
