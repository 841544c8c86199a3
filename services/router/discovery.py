"""Workers found through DNS: a pool entry `dns:///NAME:PORT` stands for every address NAME has.

On Kubernetes NAME is a pool's headless Service, whose DNS answer lists the pool's ready pods;
in docker-compose it is a service with `deploy.replicas`. Every `interval_s` each name is
resolved again: an address that appeared joins the pool (in rotation once its health check
passes, which it gets at once), one that left the answer leaves the pool (no new requests; the
ones already on it finish over their own calls, whose channels then close). A failed lookup
(timeout, no server) changes nothing, so a DNS hiccup never empties a pool; an answer that the
name does not exist, or has no address, does empty it. Plain host:port entries stay as they
are (a static list).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import dns.asyncresolver
import dns.exception
import dns.resolver

from kvmesh.background import stop_loop
from kvmesh.errors import NotFound
from services.router.pools import PoolRegistry, Role
from services.router.tiers import PoolsConfig, TierSpec

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"


class LookupFailed(Exception):
    """The resolver gave no answer (timeout, unreachable server): the pool stays as it was."""


@dataclass(slots=True, frozen=True)
class DnsTarget:
    """A pool entry to resolve: DNS name and the port every address serves on."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{DNS_SCHEME}{self.host}:{self.port}"


@dataclass(slots=True, frozen=True)
class PoolTarget:
    """A DNS target of one pool of one tier."""

    tier: str
    role: Role
    target: DnsTarget


def dns_target(entry: str) -> DnsTarget | None:
    """The name and port of a `dns:///NAME:PORT` pool entry; None for a plain host:port."""
    if not entry.startswith(DNS_SCHEME):
        return None
    host, _, port = entry.removeprefix(DNS_SCHEME).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"pool entry {entry!r} is not dns:///NAME:PORT")
    return DnsTarget(host, int(port))


def _static(entries: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(entry for entry in entries if dns_target(entry) is None)


def split_dns_entries(config: PoolsConfig) -> tuple[PoolsConfig, list[PoolTarget]]:
    """The pools with their static addresses only, and the DNS targets taken out of them."""
    targets: list[PoolTarget] = []
    tiers: list[TierSpec] = []
    for tier in config.tiers:
        for role in Role:
            for entry in getattr(tier, role.value):
                target = dns_target(entry)
                if target is not None:
                    targets.append(PoolTarget(tier.name, role, target))
        tiers.append(
            dataclasses.replace(
                tier,
                prefill=_static(tier.prefill),
                decode=_static(tier.decode),
                colocated=_static(tier.colocated),
            )
        )
    return dataclasses.replace(config, tiers=tuple(tiers)), targets


def worker_address(ip: str, port: int) -> str:
    """host:port for an IPv4 or IPv6 address ([v6]:port)."""
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


@dataclass(slots=True)
class DnsResolver:
    """A and AAAA lookups through the system's resolver configuration or one given server."""

    nameserver: str = ""
    """host:port of the DNS server to ask; empty: /etc/resolv.conf (with its search domains, so
    a Service's short name resolves inside its namespace)."""
    timeout_s: float = 2.0
    """Deadline of one lookup."""
    _resolver: dns.asyncresolver.Resolver | None = None

    def resolver(self) -> dns.asyncresolver.Resolver:
        if self._resolver is None:
            resolver = dns.asyncresolver.Resolver(configure=not self.nameserver)
            if self.nameserver:
                host, _, port = self.nameserver.rpartition(":")
                resolver.nameservers = [host.strip("[]")]
                resolver.port = int(port)
            resolver.lifetime = self.timeout_s
            self._resolver = resolver
        return self._resolver

    async def addresses(self, host: str) -> list[str]:
        """Every IP address of `host`, sorted; empty when the name does not exist or has none.

        Raises LookupFailed when no server answered."""
        found: list[str] = []
        for record_type in ("A", "AAAA"):
            try:
                answer = await self.resolver().resolve(host, record_type, search=True)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            except dns.exception.DNSException as error:
                raise LookupFailed(f"{host} {record_type}: {error}") from error
            found.extend(record.to_text() for record in answer)
        return sorted(set(found))


@dataclass(slots=True)
class DnsDiscovery:
    """Keeps each DNS-named pool's members equal to the name's current addresses."""

    registry: PoolRegistry
    targets: list[PoolTarget]
    resolver: DnsResolver
    interval_s: float
    check_now: Callable[[list[str]], Awaitable[None]]
    """Health-checks newly found workers at once (the monitor's check_many)."""
    retire: Callable[[str], None]
    """Closes a departed worker's channels once its running calls end (Peers.retire)."""
    _members: dict[PoolTarget, set[str]] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        """Resolves every target once and adds or removes the workers that changed."""
        joined: list[str] = []
        for pool in self.targets:
            try:
                ips = await self.resolver.addresses(pool.target.host)
            except LookupFailed as error:
                log.warning("cannot resolve %s (pool kept as it was): %s", pool.target, error)
                continue
            joined += self._update(pool, {worker_address(ip, pool.target.port) for ip in ips})
        if joined:
            await self.check_now(joined)

    def _update(self, pool: PoolTarget, current: set[str]) -> list[str]:
        """Applies one target's answer; returns the addresses that joined."""
        known = self._members.setdefault(pool, set())
        for address in sorted(known - current):
            with contextlib.suppress(NotFound):  # already removed by hand (RemoveWorker)
                self.registry.remove(address)
            self.retire(address)
            log.info("worker %s left %s: draining", address, pool.target)
        joined = []
        for address in sorted(current - known):
            if address in self.registry.addresses():
                continue  # also listed statically or under another name: keep the one entry
            self.registry.add(pool.tier, pool.role, address)
            joined.append(address)
            log.info("worker %s found through %s", address, pool.target)
        self._members[pool] = (known & current) | set(joined)
        return joined

    def start(self) -> None:
        """Starts re-resolving every interval (the first round after one interval)."""
        if self.targets:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()

    async def stop(self) -> None:
        if self._task is not None:
            await stop_loop(self._task)
