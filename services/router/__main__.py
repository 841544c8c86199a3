"""`python -m services.router --config pools.yaml`: the router."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.config import load_config
from kvmesh.grpc_server import (
    GrpcServer,
    ServiceBinding,
    configure_logging,
    run_service_main,
    serve,
)
from kvmesh.mesh_auth import ROUTER_MEMBER_NAME, MeshMember, MeshRole, mesh_guard
from kvmesh.mesh_keys import MeshKeys
from kvmesh.tls import tls_of
from kvmesh.v1 import router_pb2, router_pb2_grpc
from services.router.config import RouterConfig
from services.router.discovery import DnsDiscovery, DnsResolver, split_dns_entries
from services.router.monitor import WorkerMonitor
from services.router.orchestrator import Orchestrator
from services.router.peers import Peers
from services.router.pools import PoolRegistry
from services.router.scaling import ScalingPolicy
from services.router.servicer import RouterServicer
from services.router.tiers import load_pools
from services.router.worker_client import GrpcWorkers

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


@dataclass(slots=True)
class Router:
    """The router's parts, wired: registry, monitor, orchestrator, servicer, gRPC server."""

    registry: PoolRegistry
    monitor: WorkerMonitor
    discovery: DnsDiscovery
    peers: Peers
    server: GrpcServer

    async def start_background(self) -> None:
        """Resolves the DNS-named pools and checks every worker once, then starts the refresh
        loops (not the server)."""
        await self.discovery.refresh()
        await self.monitor.check_all()
        self.monitor.start()
        self.discovery.start()

    async def start(self) -> None:
        """Starts everything, the server included (in-process use)."""
        await self.start_background()
        await self.server.start()

    async def stop(self) -> None:
        """Stops serving; the server's stop hook ends the monitor and closes the channels."""
        await self.server.stop(0)


def build_router(config: RouterConfig) -> Router:
    """A router over the pools file the config names, not yet started."""
    config.validate()
    pools, dns_targets = split_dns_entries(load_pools(config.config))
    registry = PoolRegistry(pools)
    keys = MeshKeys.from_file(config.mesh_secret_file)
    tls = tls_of(config)
    peers = Peers(MeshMember(MeshRole.ROUTER, ROUTER_MEMBER_NAME, keys, tls))
    scaling = ScalingPolicy(
        target_throughput_utilization=config.scale_target_utilization,
        warm_buffer=config.scale_warm_buffer,
    )
    monitor = WorkerMonitor(
        registry, peers, config.refresh_interval_s, config.check_timeout_s, scaling
    )
    orchestrator = Orchestrator(
        registry,
        GrpcWorkers(peers),
        monitor,
        config.load_cost_tokens,
        config.lease_ttl_ms,
        stall_steps=config.stall_steps,
        stall_floor_s=config.stall_floor_s,
        stall_step_tokens=config.stall_step_tokens,
    )
    servicer = RouterServicer(registry, orchestrator, monitor)
    resolver = DnsResolver(config.dns_server, config.check_timeout_s)
    discovery = DnsDiscovery(
        registry, dns_targets, resolver, config.dns_interval_s, monitor.check_many, peers.retire
    )

    async def close() -> None:
        await discovery.stop()
        await monitor.stop()
        await orchestrator.close()
        await peers.close()

    binding = ServiceBinding(SERVICE_NAME, servicer, router_pb2_grpc.add_RouterServicer_to_server)
    server = GrpcServer(
        config, "router", [binding], on_stop=[close], guard=mesh_guard(keys, tls), tls=tls
    )
    return Router(registry, monitor, discovery, peers, server)


async def _run(config: RouterConfig) -> None:
    router = build_router(config)
    await router.start_background()
    await serve(router.server)


def main(argv: Sequence[str] | None = None) -> None:
    """Parses the configuration and serves until SIGTERM."""
    config = load_config(RouterConfig, argv)
    configure_logging(config, "router")
    asyncio.run(_run(config))


if __name__ == "__main__":
    sys.exit(run_service_main("router", lambda: main(sys.argv[1:])))
