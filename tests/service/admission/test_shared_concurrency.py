"""Two gateways on one Redis enforce one max_concurrent per tenant (real gRPC on loopback, the
real Redis on 127.0.0.1:6379, a stand-in router that holds requests open)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from redis.asyncio import Redis
from tokenizers import Tokenizer, models, pre_tokenizers

import kvmesh
from kvmesh.config import ServerConfig
from kvmesh.errors import ResourceExhausted
from kvmesh.grpc_server import GrpcServer, ServiceBinding
from kvmesh.v1 import common_pb2, gateway_pb2, router_pb2, router_pb2_grpc
from services.admission.tenants import Tenant, add_tenant
from tests.service.admission.conftest import REDIS_URL, StartGateway

TIER = "tiny"
HOLD = {"hold": "yes"}
"""Labels of a request the router keeps streaming until the test lets it finish."""


class HoldingRouter(router_pb2_grpc.RouterServicer):
    """One tier; answers with one token, then (for requests labelled HOLD) waits for `go`."""

    def __init__(self) -> None:
        self.go = asyncio.Event()

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        return gateway_pb2.ListModelsResponse(
            models=[gateway_pb2.ModelInfo(id=TIER, context_length=512, available=True)]
        )

    async def Generate(
        self,
        request_iterator: AsyncIterator[router_pb2.RouteMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        request = (await anext(aiter(request_iterator))).request
        yield common_pb2.GenerateEvent(
            started=common_pb2.Started(request_id=request.request_id, model=TIER)
        )
        yield common_pb2.GenerateEvent(chunk=common_pb2.TokenChunk(token_ids=[1], text=" one"))
        if dict(request.labels) == HOLD:
            await self.go.wait()
        yield common_pb2.GenerateEvent(
            finished=common_pb2.Finished(finish_reason=common_pb2.FINISH_REASON_LENGTH)
        )


@pytest.fixture
async def router() -> AsyncIterator[tuple[str, HoldingRouter]]:
    servicer = HoldingRouter()  # type: ignore[abstract]  # serves ListModels and Generate only
    name = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
    binding = ServiceBinding(name, servicer, router_pb2_grpc.add_RouterServicer_to_server)
    server = GrpcServer(ServerConfig(metrics_port=-1), "router", [binding])
    await server.start()
    try:
        yield server.address, servicer
    finally:
        await server.stop(0)


@pytest.fixture
def word_tokenizer(tmp_path: Path) -> Path:
    """A tokenizer folder the gateway loads in milliseconds (whitespace-separated words)."""
    vocab = {word: i for i, word in enumerate(["[UNK]", "hello", "one", "more"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


@dataclass(slots=True)
class SharedGateways:
    """Two gateways on one Redis prefix in front of the holding router."""

    a: str
    b: str
    keys: dict[str, str]
    """API key per tenant: "single" may run one request at a time, "other" any number."""
    router: HoldingRouter
    redis: Redis
    slots_key: str
    """The Redis set of the leases of "single"."""

    def client(self, address: str, tenant: str = "single") -> kvmesh.Client:
        return kvmesh.Client(address, api_key=self.keys[tenant])


@pytest.fixture
async def gateways(
    redis: tuple[Redis, str],
    router: tuple[str, HoldingRouter],
    word_tokenizer: Path,
    start_gateway: StartGateway,
    tmp_path: Path,
) -> SharedGateways:
    client, prefix = redis
    tenants = tmp_path / "tenants.yaml"
    specs = [
        Tenant(name="single", key_sha256="", max_concurrent=1),
        Tenant(name="other", key_sha256=""),
    ]
    keys = {spec.name: add_tenant(tenants, spec)[1] for spec in specs}
    flags = ["--router", router[0], "--tenants", str(tenants), "--redis", REDIS_URL,
             "--redis-prefix", prefix, "--default-tokenizer", str(word_tokenizer)]  # fmt: skip
    a, b = await start_gateway(flags), await start_gateway(flags)
    return SharedGateways(a, b, keys, router[1], client, f"{prefix}slots:{{single}}")


async def test_two_gateways_share_one_max_concurrent(gateways: SharedGateways) -> None:
    on_a, on_b = gateways.client(gateways.a), gateways.client(gateways.b)
    other_on_b = gateways.client(gateways.b, "other")
    async with on_a, on_b, other_on_b:
        async with on_a.stream("hello", max_tokens=8, labels=HOLD) as running:
            assert (await anext(running)).text == " one"  # the slot is held on gateway A
            with pytest.raises(ResourceExhausted) as raised:
                await on_b.generate("one more", max_tokens=2)
            violation = raised.value.quota_violations[0]
            assert violation.subject == "tenant:single"
            assert "concurrent requests: 1 of 1" in violation.description
            assert raised.value.retry_after_s is not None and raised.value.retry_after_s > 0
            # Gateway B keeps serving: other tenants, and it shed nothing but that request.
            assert (await other_on_b.generate("hello", max_tokens=2)).finish_reason == "length"
            gateways.router.go.set()
            async for _ in running:
                pass
        assert running.result.finish_reason == "length"
        # The slot was given back in Redis before A's call ended: B admits the next one.
        assert await gateways.redis.zcard(gateways.slots_key) == 0
        assert (await on_b.generate("one more", max_tokens=2)).finish_reason == "length"


async def test_a_stream_closed_early_gives_its_slot_back(gateways: SharedGateways) -> None:
    async with gateways.client(gateways.a) as on_a, gateways.client(gateways.b) as on_b:
        async with on_a.stream("hello", max_tokens=8, labels=HOLD) as running:
            await anext(running)
            assert await gateways.redis.zcard(gateways.slots_key) == 1
        # Closing cuts the call; gateway A sees it asynchronously, and its task is cancelled.
        deadline = time.monotonic() + 2.0
        while await gateways.redis.zcard(gateways.slots_key):
            assert time.monotonic() < deadline, "the cancelled stream kept its slot"
            await asyncio.sleep(0.05)
        assert (await on_b.generate("one more", max_tokens=2)).finish_reason == "length"
