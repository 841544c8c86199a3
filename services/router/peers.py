"""gRPC channels to the workers: traced ones for requests, untraced ones for the monitor.

The monitor's health checks and Stats refreshes belong to no request; a trace per poll would
bury the requests' traces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvmesh.channels import member_channel
from kvmesh.mesh_auth import MeshMember
from kvmesh.v1 import worker_pb2_grpc


@dataclass(slots=True)
class Peers:
    """Channels to the workers, opened on first use and kept (gRPC reconnects by itself);
    every call carries the router's mesh identity."""

    member: MeshMember
    _channels: dict[tuple[str, bool], grpc.aio.Channel] = field(default_factory=dict)

    def _channel(self, address: str, traced: bool) -> grpc.aio.Channel:
        channel = self._channels.get((address, traced))
        if channel is None:
            channel = self._channels[address, traced] = member_channel(address, self.member, traced)
        return channel

    def worker(self, address: str, traced: bool = True) -> worker_pb2_grpc.WorkerStub:
        """The Worker stub of `address`; traced=False for background polling."""
        return worker_pb2_grpc.WorkerStub(self._channel(address, traced))

    def health(self, address: str) -> health_pb2_grpc.HealthStub:
        """The standard health stub of `address` (untraced: only the monitor polls it)."""
        return health_pb2_grpc.HealthStub(self._channel(address, traced=False))

    async def close(self) -> None:
        """Closes every channel (at shutdown)."""
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
