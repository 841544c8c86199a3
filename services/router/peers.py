"""One gRPC channel per worker address, shared by the monitor and the orchestrator."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvmesh.channels import insecure_channel
from kvmesh.v1 import worker_pb2_grpc


@dataclass(slots=True)
class Peers:
    """Channels to the workers, opened on first use and kept (gRPC reconnects by itself)."""

    _channels: dict[str, grpc.aio.Channel] = field(default_factory=dict)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = insecure_channel(address)
        return channel

    def worker(self, address: str) -> worker_pb2_grpc.WorkerStub:
        """The Worker stub of `address`."""
        return worker_pb2_grpc.WorkerStub(self._channel(address))

    def health(self, address: str) -> health_pb2_grpc.HealthStub:
        """The standard health stub of `address`."""
        return health_pb2_grpc.HealthStub(self._channel(address))

    async def close(self) -> None:
        """Closes every channel (at shutdown)."""
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
