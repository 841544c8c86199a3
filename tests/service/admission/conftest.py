"""Fixtures of the gateway's service tests: the real Redis under a fresh prefix, a Redis that
is not there, and in-process gateway servers on loopback."""

from __future__ import annotations

import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import pytest
from redis.asyncio import Redis

from kvmesh.config import load_config
from kvmesh.grpc_server import GrpcServer, ServiceBinding
from kvmesh.v1 import gateway_pb2_grpc
from services.admission.config import AdmissionConfig
from services.admission.servicer import SERVICE_NAME, GatewayServicer
from services.admission.wiring import build_gateway

REDIS_URL = "redis://127.0.0.1:6379/0"

StartGateway = Callable[[Sequence[str]], Awaitable[str]]


@pytest.fixture
async def redis() -> AsyncIterator[tuple[Redis, str]]:
    """A client of the real Redis and a key prefix of this test's own (deleted afterwards)."""
    client = Redis.from_url(REDIS_URL, socket_timeout=1.0)
    prefix = f"test:admission:{uuid.uuid4().hex}:"
    try:
        yield client, prefix
    finally:
        keys = [key async for key in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
async def unreachable_redis(closed_port: int) -> AsyncIterator[Redis]:
    """A Redis client whose every call fails fast (connection refused)."""
    client = Redis.from_url(
        f"redis://127.0.0.1:{closed_port}/0", socket_timeout=0.2, socket_connect_timeout=0.2
    )
    yield client
    await client.aclose()


@pytest.fixture
async def start_gateway() -> AsyncIterator[StartGateway]:
    """Starts in-process gateways with the given flags (on a free port, without metrics) and
    returns each one's address; they are stopped after the test."""
    servers: list[GrpcServer] = []

    async def start(flags: Sequence[str]) -> str:
        config = load_config(AdmissionConfig, ["--port", "0", "--metrics-port", "-1", *flags])
        assembly = build_gateway(config)
        servicer = GatewayServicer(assembly.gateway)
        binding = ServiceBinding(
            SERVICE_NAME, servicer, gateway_pb2_grpc.add_GatewayServicer_to_server
        )
        server = GrpcServer(config, "admission", [binding], on_stop=assembly.on_stop)
        await server.start()
        servers.append(server)
        return server.address

    try:
        yield start
    finally:
        for server in servers:
            await server.stop(0)
