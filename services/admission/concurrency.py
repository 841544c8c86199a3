"""Requests in flight per tenant (its max_concurrent), one count across gateways sharing Redis.

Each request in flight holds a slot of its tenant. In Redis a tenant's slots are the members of
one sorted set, scored by when their lease ends: a gateway that dies mid-request never gives
its slots back, so they must end on their own, and a live gateway renews the leases of the
slots it holds every third of a lease. Taking a slot is one Lua script (drop ended leases,
count, add), so two gateways never both take the last one; leases are timed by the Redis
server's clock, so gateways whose clocks disagree still agree on them. Without Redis, or while
it is unreachable (services.admission.failover), each gateway counts its own requests only.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from redis.asyncio import Redis

from services.admission import metrics
from services.admission.failover import Failover, Retries, StoreDown, redis_calls

log = logging.getLogger(__name__)


class SlotStore(Protocol):
    """Slots held per tenant; implementations must check and take a slot atomically."""

    name: str

    async def try_acquire(self, tenant: str, holder: str, limit: int) -> bool:
        """Takes a slot for `holder` unless the tenant holds `limit` already."""
        ...

    async def release(self, tenant: str, holder: str) -> None:
        """Gives `holder`'s slot back (nothing happens when it holds none)."""
        ...

    async def adopt(self, tenant: str, holder: str) -> None:
        """Counts `holder`'s slot here, whatever the limit: a request already running that
        was counted elsewhere (locally, while this store was down)."""
        ...


class MemorySlots:
    """Slots in this process (one gateway, or the fallback while Redis is down)."""

    name = "memory"

    def __init__(self) -> None:
        self._held: dict[str, set[str]] = {}

    async def try_acquire(self, tenant: str, holder: str, limit: int) -> bool:
        held = self._held.setdefault(tenant, set())
        if len(held) >= limit:
            return False
        held.add(holder)
        return True

    async def release(self, tenant: str, holder: str) -> None:
        _discard(self._held, tenant, holder)

    async def adopt(self, tenant: str, holder: str) -> None:
        self._held.setdefault(tenant, set()).add(holder)


# KEYS: the tenant's sorted set. ARGV: holder, limit, lease in ms.
_ACQUIRE = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS: the tenant's sorted set. ARGV: holder, lease in ms. Unchecked: the request runs.
_ADOPT = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: the tenant's sorted set. ARGV: lease in ms, then the holders to renew. XX: a slot
# released meanwhile, or whose lease already ended and was taken over, is not brought back.
_RENEW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i])
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
return 0
"""


class RedisSlots:
    """Slots as leases in Redis, shared by every gateway using the same URL and prefix."""

    name = "redis"

    def __init__(self, client: Redis, prefix: str, lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError(f"the concurrency lease must be positive, got {lease_s} s")
        self._client = client
        self._prefix = prefix
        self._lease_s = lease_s
        self._lease_ms = max(round(lease_s * 1000), 1)
        self._acquire = client.register_script(_ACQUIRE)
        self._adopt = client.register_script(_ADOPT)
        self._renew = client.register_script(_RENEW)
        self._live: dict[str, set[str]] = {}
        """tenant -> holders in this gateway, whose leases it renews."""
        self._renewer: asyncio.Task[None] | None = None

    def _key(self, tenant: str) -> str:
        # The {tenant} hash tag keeps the key in one cluster slot, like the budget counters.
        return f"{self._prefix}slots:{{{tenant}}}"

    async def try_acquire(self, tenant: str, holder: str, limit: int) -> bool:
        with redis_calls():
            taken = await self._acquire(
                keys=[self._key(tenant)], args=[holder, limit, self._lease_ms]
            )
        if taken:
            self._live.setdefault(tenant, set()).add(holder)
            self._keep_renewing()
        return bool(taken)

    async def adopt(self, tenant: str, holder: str) -> None:
        with redis_calls():
            await self._adopt(keys=[self._key(tenant)], args=[holder, self._lease_ms])
        self._live.setdefault(tenant, set()).add(holder)
        self._keep_renewing()

    async def release(self, tenant: str, holder: str) -> None:
        # Forgotten first: if the removal fails (or is cancelled), the lease is no longer
        # renewed and ends on its own.
        _discard(self._live, tenant, holder)
        with redis_calls():
            await self._client.zrem(self._key(tenant), holder)

    async def renew(self) -> None:
        """Extends the lease of every slot this gateway holds to a whole lease from now."""
        for tenant, holders in list(self._live.items()):
            with redis_calls():
                await self._renew(keys=[self._key(tenant)], args=[self._lease_ms, *holders])

    async def close(self) -> None:
        """Stops renewing; slots still held then end with their leases."""
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)

    def _keep_renewing(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.ensure_future(self._renew_while_held())

    async def _renew_while_held(self) -> None:
        while self._live:
            await asyncio.sleep(self._lease_s / 3)
            try:
                await self.renew()
            except StoreDown as error:
                metrics.BACKEND_ERRORS.labels("concurrency").inc()
                log.warning(
                    "cannot renew concurrency leases in Redis (%s): they end within %.0f s",
                    error,
                    self._lease_s,
                )


def _discard(held: dict[str, set[str]], tenant: str, holder: str) -> None:
    """Removes `holder` from `tenant`'s set, and the set once empty."""
    holders = held.get(tenant)
    if holders is not None:
        holders.discard(holder)
        if not holders:
            del held[tenant]


@dataclass(slots=True, eq=False)
class Slot:
    """One request's place among its tenant's requests in flight."""

    tenant: str
    holder: str
    store: SlotStore
    """Where it is counted (the fallback while Redis was down, until Redis adopts it): it is
    given back there."""


class ConcurrencyLimits:
    """Takes and gives back tenants' slots; counts locally while the shared store is down.

    When the store answers again, the slots taken locally meanwhile are added to it before
    anything else is asked of it, so the limit is exact across gateways at once. A release
    the store could not take is retried every RETRY_S until it lands or the slot's lease has
    ended on its own: a tenant is not throttled for a whole lease after an outage."""

    def __init__(
        self, store: SlotStore, fallback: MemorySlots | None = None, lease_s: float = 30.0
    ) -> None:
        self._store = store
        self._fallback = fallback
        self._stores = Failover[SlotStore](
            store, fallback, role="concurrency", on_recovery=self._adopt_local
        )
        self._lease_s = lease_s
        self._local: set[Slot] = set()
        """Slots counted in the fallback, held still."""
        self._releases = Retries("slot releases")

    async def acquire(self, tenant: str, limit: int) -> Slot | None:
        """A slot, or None when the tenant already has `limit` requests in flight."""
        holder = uuid.uuid4().hex
        # With no store answering the request goes ahead uncounted (fail open).
        store, taken = await self._stores.call(
            lambda s: s.try_acquire(tenant, holder, limit), default=True
        )
        if not taken:
            return None
        slot = Slot(tenant, holder, store)
        if store is self._fallback:
            self._local.add(slot)
            self._stores.probe_while(lambda: bool(self._local))
        return slot

    async def release(self, slot: Slot) -> None:
        """Gives the slot back; if the store is unreachable, retried until it lands."""
        self._local.discard(slot)
        try:
            await slot.store.release(slot.tenant, slot.holder)
        except StoreDown as error:
            self._stores.failed(error)
            store = slot.store
            self._releases.add(
                lambda: store.release(slot.tenant, slot.holder),
                until=time.monotonic() + self._lease_s,
            )

    async def _adopt_local(self) -> None:
        """The store is back: the slots counted locally meanwhile move into it."""
        assert self._fallback is not None  # only a fallback counts locally
        for slot in list(self._local):
            await self._store.adopt(slot.tenant, slot.holder)  # StoreDown: still down
            if slot not in self._local:  # released while it was being adopted
                await self._store.release(slot.tenant, slot.holder)
                continue
            slot.store = self._store
            self._local.discard(slot)
            await self._fallback.release(slot.tenant, slot.holder)

    async def close(self) -> None:
        """Stops retrying releases (their leases end on their own)."""
        await self._releases.close()
        await self._stores.close()
