"""gRPC channels to the workers: traced ones for requests, untraced ones for the monitor.

The monitor's health checks and Stats refreshes belong to no request; a trace per poll would
bury the requests' traces. A worker that left its pool (its address gone from DNS) has its
channels retired: no new call uses them, and each closes once the calls still running on it
have ended, so the router holds no connection (and no keepalive pings, no reconnect attempts)
to every pod address that ever served.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvmesh.channels import member_channel
from kvmesh.mesh_auth import MeshMember
from kvmesh.v1 import worker_pb2_grpc

RETIRED_GRACE_S = 3600.0
"""Longest a retired channel waits for its running calls before it closes under them: the
router never cuts a stream on a leaving worker short itself (the caller's deadline does)."""


@dataclass(slots=True)
class Peers:
    """Channels to the workers, opened on first use and kept (gRPC reconnects by itself);
    every call carries the router's mesh identity."""

    member: MeshMember
    _channels: dict[tuple[str, bool], grpc.aio.Channel] = field(default_factory=dict)
    _closing: dict[grpc.aio.Channel, asyncio.Task[None]] = field(default_factory=dict)
    """Retired channels, each closing once its calls have ended."""
    on_retire: list[Callable[[str], None]] = field(default_factory=list)
    """Told each retired address first: whoever keeps an idle call open on its channels
    (GrpcWorkers' GenerateMany call) ends it, so that the channel can close."""

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

    def opened(self, address: str) -> bool:
        """Whether a channel to `address` is open for new calls."""
        return any(key[0] == address for key in self._channels)

    @property
    def closing(self) -> int:
        """Retired channels whose calls are still running."""
        return len(self._closing)

    def retire(self, address: str) -> None:
        """Takes `address`'s channels out of use (a call to it later opens a new one) and closes
        each when its running calls have ended (grpc's close grace), at most RETIRED_GRACE_S."""
        for told in self.on_retire:
            told(address)
        for traced in (True, False):
            channel = self._channels.pop((address, traced), None)
            if channel is not None:
                task = asyncio.create_task(channel.close(grace=RETIRED_GRACE_S))
                self._closing[channel] = task
                task.add_done_callback(functools.partial(self._closed, channel))

    def _closed(self, channel: grpc.aio.Channel, _: asyncio.Task[None]) -> None:
        self._closing.pop(channel, None)

    async def close(self) -> None:
        """Closes every channel, retired ones included (at shutdown)."""
        for channel in [*self._channels.values(), *self._closing]:
            await channel.close()
        for task in list(self._closing.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._channels.clear()
