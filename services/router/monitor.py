"""Keeps the registry's view of every worker fresh: standard health check, then Stats.

Every `interval_s` all workers are checked concurrently. A worker whose health check says
anything but SERVING, or whose health or Stats call fails or misses `timeout_s`, leaves the
rotation until a later check passes. The orchestrator checks the workers of a failed attempt
at once, so that a dead worker stops receiving requests before the retry is placed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2

from kvmesh.background import stop_loop
from kvmesh.v1 import worker_pb2
from services.router import metrics
from services.router.peers import Peers
from services.router.pools import PoolRegistry, Role
from services.router.scaling import ScalingPolicy, recommended_replicas, worker_load

log = logging.getLogger(__name__)

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


@dataclass(slots=True)
class WorkerMonitor:
    """The background refresh loop over a PoolRegistry."""

    registry: PoolRegistry
    peers: Peers
    interval_s: float
    timeout_s: float
    scaling: ScalingPolicy = field(default_factory=ScalingPolicy)
    _task: asyncio.Task[None] | None = None

    async def check(self, address: str) -> bool:
        """Checks one worker now and records the result; True when it is healthy."""
        try:
            health = await self.peers.health(address).Check(
                health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=self.timeout_s
            )
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
                self._record(address, None, f"health: {status}")
                return False
            if address not in self.registry.addresses():
                # It left while being checked: asking its stats would reopen the channel that
                # leaving retired (Peers.retire), to a worker no longer polled or routed to.
                return False
            stats = await self.peers.worker(address, traced=False).Stats(
                worker_pb2.StatsRequest(include_block_hashes=True), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as error:
            self._record(address, None, f"{error.code().name}: {error.details()}")
            return False
        self._record(address, stats, "")
        return True

    def _record(self, address: str, stats: worker_pb2.WorkerStats | None, error: str) -> None:
        was_healthy = any(w.healthy for w in self.registry.workers() if w.address == address)
        self.registry.record_check(address, stats, error)
        if was_healthy and stats is None:
            log.warning("worker %s left the rotation: %s", address, error)
        elif not was_healthy and stats is not None:
            log.info("worker %s is in rotation", address)

    async def check_many(self, addresses: Iterable[str]) -> None:
        """Checks some workers concurrently."""
        await asyncio.gather(*(self.check(a) for a in addresses))

    async def check_all(self) -> None:
        """Checks every worker concurrently."""
        await self.check_many(self.registry.addresses())
        self._export_gauges()

    def recommended(self, tier: str, role: Role) -> int:
        """Replicas the pool should have for the load its workers reported last."""
        spec = self.registry.tier(tier)
        workers = self.registry.workers(tier, role)
        return recommended_replicas(
            [worker_load(w) for w in workers], spec.tokens_per_second, self.scaling
        )

    def _export_gauges(self) -> None:
        for tier in self.registry.tiers:
            for worker_role in {w.role for w in self.registry.workers(tier.name)}:
                labels = (tier.name, worker_role.value)
                metrics.HEALTHY_WORKERS.labels(*labels).set(
                    len(self.registry.in_rotation(tier.name, worker_role))
                )
                metrics.RECOMMENDED_REPLICAS.labels(*labels).set(
                    self.recommended(tier.name, worker_role)
                )

    def start(self) -> None:
        """Starts the refresh loop (its first round after one interval; see check_all)."""
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check_all()

    async def stop(self) -> None:
        """Stops the loop."""
        if self._task is not None:
            await stop_loop(self._task)
