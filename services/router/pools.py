"""The router's view of its workers: which pool each is in, whether it is healthy, how loaded.

A worker is in rotation while its latest health check and Stats call succeeded and it is not
draining; one failed check takes it out until a later check passes. `inflight` counts the
requests this router has placed on a worker and not yet seen finish, so placement reacts to its
own decisions before the next Stats refresh shows them.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvmesh.errors import InvalidArgument, NotFound
from kvmesh.v1 import worker_pb2
from services.router.tiers import PoolsConfig, TierSpec


class Role(enum.Enum):
    """The three pools of a tier."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"

    @property
    def proto(self) -> worker_pb2.WorkerRole.ValueType:
        """The WorkerRole enum value on the wire."""
        return _ROLE_TO_PROTO[self]

    @classmethod
    def from_proto(cls, role: worker_pb2.WorkerRole.ValueType) -> Role:
        """The pool for a WorkerRole; InvalidArgument for UNSPECIFIED."""
        for member, value in _ROLE_TO_PROTO.items():
            if value == role:
                return member
        raise InvalidArgument("role", "must be PREFILL, DECODE or BOTH (colocated)")


_ROLE_TO_PROTO = {
    Role.PREFILL: worker_pb2.WORKER_ROLE_PREFILL,
    Role.DECODE: worker_pb2.WORKER_ROLE_DECODE,
    Role.COLOCATED: worker_pb2.WORKER_ROLE_COLOCATED,
}


@dataclass(slots=True)
class WorkerState:
    """One worker in one pool, as last observed."""

    address: str
    tier: str
    role: Role
    healthy: bool = False
    """The latest health check and Stats call both succeeded."""
    stats: worker_pb2.WorkerStats | None = None
    """The latest Stats reply."""
    cached_hashes: frozenset[bytes] = frozenset()
    """Block hashes in the worker's prefix cache at the latest refresh."""
    inflight: int = 0
    """Requests this router has on the worker now."""
    last_placed: int = 0
    """The registry's placement count when it last placed an attempt here (0: never);
    least-load breaks a tie for the worker that has waited longest."""
    last_error: str = ""
    """Why the latest check failed (empty when it passed)."""

    @property
    def in_rotation(self) -> bool:
        """Eligible for new requests."""
        return self.healthy and not (self.stats is not None and self.stats.draining)

    @property
    def load(self) -> int:
        """Requests on the worker: its own count or ours, whichever is larger (Stats lag)."""
        reported = self.stats.running + self.stats.waiting if self.stats is not None else 0
        return max(reported, self.inflight)

    @property
    def revision(self) -> tuple[str, bytes, str] | None:
        """What must agree for a KV hand-off: model fingerprint, KV layout, kvmesh release
        (None until a Stats reply arrived)."""
        if self.stats is None:
            return None
        layout = self.stats.layout.SerializeToString(deterministic=True)
        return (self.stats.model_fingerprint, layout, self.stats.kvmesh_version)

    @property
    def kv_blocks_free(self) -> int:
        return self.stats.kv_blocks_free if self.stats is not None else 0

    @property
    def kv_blocks_total(self) -> int:
        return self.stats.kv_blocks_total if self.stats is not None else 0


@dataclass(slots=True)
class PoolRegistry:
    """Every worker of every tier, in configuration order."""

    config: PoolsConfig
    _workers: list[WorkerState] = field(default_factory=list)
    _departures: dict[str, asyncio.Event] = field(default_factory=dict)
    _placements: int = 0

    def __post_init__(self) -> None:
        for tier in self.config.tiers:
            for role, addresses in (
                (Role.PREFILL, tier.prefill),
                (Role.DECODE, tier.decode),
                (Role.COLOCATED, tier.colocated),
            ):
                for address in addresses:
                    self.add(tier.name, role, address)

    @property
    def tiers(self) -> tuple[TierSpec, ...]:
        return self.config.tiers

    def tier(self, name: str) -> TierSpec:
        """The tier called `name`; InvalidArgument when unknown."""
        spec = self.config.tier(name)
        if spec is None:
            known = ", ".join(t.name for t in self.config.tiers)
            raise InvalidArgument("model", f"unknown model {name!r} (known: {known}, auto)")
        return spec

    def workers(self, tier: str | None = None, role: Role | None = None) -> list[WorkerState]:
        """Workers of a tier and role (None: any), in the order they were added."""
        return [
            w
            for w in self._workers
            if (tier is None or w.tier == tier) and (role is None or w.role == role)
        ]

    def in_rotation(self, tier: str, role: Role) -> list[WorkerState]:
        """Workers of a pool that may take new requests."""
        return [w for w in self.workers(tier, role) if w.in_rotation]

    def pairable_prefill(self, tier: str) -> list[WorkerState]:
        """Prefill workers in rotation that have a decode partner of their revision."""
        decode_revisions = {w.revision for w in self.in_rotation(tier, Role.DECODE)}
        return [w for w in self.in_rotation(tier, Role.PREFILL) if w.revision in decode_revisions]

    def decode_partners(self, prefill: WorkerState) -> list[WorkerState]:
        """Decode workers in rotation that can take `prefill`'s KV (the same revision), so a
        rolling update never pairs two revisions."""
        return [
            w for w in self.in_rotation(prefill.tier, Role.DECODE) if w.revision == prefill.revision
        ]

    def can_split(self, tier: str) -> bool:
        """The tier has a prefill and a decode worker of one revision in rotation."""
        return bool(self.pairable_prefill(tier))

    def serves(self, tier: str) -> bool:
        """Some placement of the tier is possible now."""
        return self.can_split(tier) or bool(self.in_rotation(tier, Role.COLOCATED))

    def fingerprint(self, tier: str) -> str | None:
        """The model fingerprint the tier's healthy workers report."""
        for worker in self.workers(tier):
            if worker.healthy and worker.stats is not None:
                return worker.stats.model_fingerprint
        return None

    def tokens_per_second(self, tier: str) -> float:
        """One worker's generation throughput: the mean of the most that the tier's decoding
        workers in rotation sustained, or the pools file's figure until one has measured it."""
        peaks = [
            worker.stats.peak_tokens_per_second
            for role in (Role.DECODE, Role.COLOCATED)
            for worker in self.in_rotation(tier, role)
            if worker.stats is not None and worker.stats.peak_tokens_per_second > 0
        ]
        return sum(peaks) / len(peaks) if peaks else self.tier(tier).tokens_per_second

    def stats_of(self, tier: str) -> worker_pb2.WorkerStats | None:
        """Stats of any healthy worker of the tier (for block size, context length)."""
        for worker in self.workers(tier):
            if worker.healthy and worker.stats is not None:
                return worker.stats
        return None

    def occupy(self, workers: tuple[WorkerState, ...]) -> None:
        """Counts an attempt on `workers` from its placement on (before it starts there, so
        the next placement sees it)."""
        self._placements += 1
        for worker in workers:
            worker.inflight += 1
            worker.last_placed = self._placements

    def vacate(self, workers: tuple[WorkerState, ...]) -> None:
        """The attempt placed on `workers` is over."""
        for worker in workers:
            worker.inflight -= 1

    def add(self, tier: str, role: Role, address: str) -> WorkerState:
        """Adds a worker to a pool; it joins the rotation once its first check passes."""
        self.tier(tier)
        if ":" not in address:
            raise InvalidArgument("address", f"{address!r} is not host:port")
        if any(w.address == address for w in self.workers(tier, role)):
            raise InvalidArgument("address", f"{address} is already in {tier}/{role.value}")
        worker = WorkerState(address=address, tier=tier, role=role)
        self._workers.append(worker)
        return worker

    def remove(self, address: str) -> list[WorkerState]:
        """Takes a worker out of every pool; NotFound when it is in none."""
        removed = [w for w in self._workers if w.address == address]
        if not removed:
            raise NotFound(f"no worker at {address}")
        self._workers = [w for w in self._workers if w.address != address]
        return removed

    def addresses(self) -> list[str]:
        """Every distinct worker address."""
        return list(dict.fromkeys(w.address for w in self._workers))

    def record_check(
        self,
        address: str,
        stats: worker_pb2.WorkerStats | None,
        error: str = "",
    ) -> None:
        """Stores a refresh result: stats on success, None and the error on failure."""
        was_in_rotation = any(w.healthy for w in self._entries(address))
        if was_in_rotation and stats is None:
            self.departure(address).set()
            del self._departures[address]  # the next time in rotation waits on a fresh one
        for worker in self._entries(address):
            worker.healthy = stats is not None
            worker.last_error = error
            if stats is not None:
                worker.stats = stats
                worker.cached_hashes = frozenset(stats.cached_block_hashes)

    def departure(self, address: str) -> asyncio.Event:
        """Set when the worker at `address` next leaves the rotation (a failed check): the
        calls running on it then stop waiting for it."""
        event = self._departures.get(address)
        if event is None:
            event = self._departures[address] = asyncio.Event()
        return event

    def _entries(self, address: str) -> Iterable[WorkerState]:
        return (w for w in self._workers if w.address == address)
