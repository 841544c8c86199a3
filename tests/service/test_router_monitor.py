"""The router's health monitor against a worker that leaves while its check is in flight.

The worker side is grpc's own standard health service on loopback, held inside Check until
the test has taken the worker out of its pool the way DNS discovery does (registry.remove,
then Peers.retire). The monitor must then not ask the departed worker for its Stats: that call
would reopen the channel retiring had just closed, to a worker no longer polled or routed to.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.mesh_auth import ROUTER_MEMBER_NAME, MeshMember, MeshRole
from kvmesh.mesh_keys import MeshKeys
from services.router.monitor import WORKER_SERVICE, WorkerMonitor
from services.router.peers import Peers
from services.router.pools import PoolRegistry, Role
from tests.unit.router.factories import registry, tier


class HeldHealth(health.aio.HealthServicer):  # type: ignore[misc]
    """SERVING for the Worker service, answered only once `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        self.asked.set()
        await self.release.wait()
        return await super().Check(request, context)


@pytest.fixture
async def held_worker() -> AsyncIterator[tuple[str, HeldHealth]]:
    servicer = HeldHealth()
    await servicer.set(WORKER_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(grace=None)


def _monitor(address: str) -> tuple[WorkerMonitor, PoolRegistry, Peers]:
    pools = registry(tier("tiny", decode=(address,)))
    peers = Peers(MeshMember(MeshRole.ROUTER, ROUTER_MEMBER_NAME, MeshKeys.from_secret("")))
    return WorkerMonitor(pools, peers, interval_s=1.0, timeout_s=5.0), pools, peers


async def test_a_worker_that_leaves_during_its_health_check_is_not_asked_for_stats(
    held_worker: tuple[str, HeldHealth],
) -> None:
    address, servicer = held_worker
    monitor, pools, peers = _monitor(address)
    check = asyncio.create_task(monitor.check(address))
    await asyncio.wait_for(servicer.asked.wait(), timeout=5)
    pools.remove(address)
    peers.retire(address)
    servicer.release.set()

    assert await asyncio.wait_for(check, timeout=5) is False
    assert not peers.opened(address)
    await peers.close()


async def test_a_worker_that_stays_is_checked_through_to_its_stats(
    held_worker: tuple[str, HeldHealth],
) -> None:
    # The same worker kept in its pool: past its health check the monitor asks its Stats,
    # which this bare health server does not serve, so the check fails on that call.
    address, servicer = held_worker
    monitor, pools, peers = _monitor(address)
    servicer.release.set()

    assert await monitor.check(address) is False
    (worker,) = pools.workers("tiny", Role.DECODE)
    assert worker.last_error.startswith("UNIMPLEMENTED")
    assert peers.opened(address)
    await peers.close()
