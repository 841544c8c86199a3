"""Internal services take calls only from their stack (issue 15 point 2): a router, a cache and
a worker started with one mesh secret refuse everyone else, each RPC by name, in the one
membership check every server runs; members of the right role get through."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.channels import member_channel
from kvmesh.config import load_config
from kvmesh.grpc_server import GrpcServer
from kvmesh.mesh_auth import (
    GATEWAY_MEMBER_NAME,
    OPERATOR_MEMBER_NAME,
    ROUTER_MEMBER_NAME,
    MeshMember,
    MeshRole,
)
from kvmesh.mesh_keys import MeshKeys
from kvmesh.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    gateway_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.cache.__main__ import build_server
from services.cache.config import CacheConfig
from services.router.__main__ import Router, build_router
from services.router.config import RouterConfig
from tests.service.worker_mesh import InProcessWorker, request, route, start_worker

SECRET = "the stack's secret"
KEYS = MeshKeys.from_secret(SECRET)
PROMPT = list(range(20, 40))
SMALL = common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)


def member(role: MeshRole, name: str = "m", keys: MeshKeys = KEYS) -> MeshMember:
    return MeshMember(role, name, keys)


GATEWAY = member(MeshRole.GATEWAY, GATEWAY_MEMBER_NAME)
ROUTER = member(MeshRole.ROUTER, ROUTER_MEMBER_NAME)
OPERATOR = member(MeshRole.OPERATOR, OPERATOR_MEMBER_NAME)
WORKER = member(MeshRole.WORKER, "127.0.0.1:1")


@dataclass
class Stack:
    worker: InProcessWorker
    router: Router
    cache: GrpcServer

    def channel(self, service: str, caller: MeshMember | None) -> grpc.aio.Channel:
        address = {
            "router": self.router.server.address,
            "cache": self.cache.address,
            "worker": self.worker.address,
        }[service]
        return member_channel(address, caller)


@pytest.fixture
async def stack(tiny_llama_dir: Path, tmp_path: Path) -> AsyncIterator[Stack]:
    secret_file = tmp_path / "mesh-secret"
    secret_file.write_text(SECRET)
    secret = ["--mesh-secret-file", str(secret_file)]
    worker = await start_worker(tiny_llama_dir, "colocated", *secret, caller=ROUTER)
    pools = tmp_path / "pools.yaml"
    tier = {"name": "tiny", "base_model": "tiny", "colocated": [worker.address]}
    pools.write_text(yaml.safe_dump({"tiers": [tier]}))
    router = build_router(
        load_config(
            RouterConfig, ["--config", str(pools), "--port", "0", "--metrics-port", "-1", *secret]
        )
    )
    await router.start()
    cache = build_server(load_config(CacheConfig, ["--port", "0", "--metrics-port", "-1", *secret]))
    await cache.start()
    yield Stack(worker, router, cache)
    await asyncio.gather(worker.stop(), router.stop(), cache.stop(0))


OUTSIDERS = [
    pytest.param(None, id="no-identity"),
    # A gateway's name and role, its token made with another stack's secret.
    pytest.param(member(MeshRole.GATEWAY, keys=MeshKeys.from_secret("guess")), id="wrong-secret"),
    pytest.param(member(MeshRole.ROUTER, keys=MeshKeys.from_secret("")), id="no-secret"),
]

Call = Callable[[grpc.aio.Channel], Any]

KEY = cache_pb2.CacheKey(model="tiny", prompt_token_ids=[1, 2], tenant="victim")
ANSWER = cache_pb2.CachedResponse(token_ids=[7], text="forged", model="tiny")


async def _stream(call: Any, message: Any) -> list[Any]:
    try:
        await call.write(message)
        return [event async for event in call]
    finally:
        call.cancel()


# Every internal RPC by name, each as an outsider would call it.
RPCS: dict[str, tuple[str, Call]] = {
    "Router.AddWorker": (
        "router",
        lambda ch: router_pb2_grpc.RouterStub(ch).AddWorker(
            router_pb2.AddWorkerRequest(
                tier="tiny", role=worker_pb2.WORKER_ROLE_COLOCATED, address="127.0.0.1:9"
            )
        ),
    ),
    "Router.RemoveWorker": (
        "router",
        lambda ch: router_pb2_grpc.RouterStub(ch).RemoveWorker(
            router_pb2.RemoveWorkerRequest(address="127.0.0.1:9")
        ),
    ),
    "Router.Generate": (
        "router",
        lambda ch: _stream(
            router_pb2_grpc.RouterStub(ch).Generate(),
            router_pb2.RouteMessage(
                request=request("r", PROMPT, SMALL, model="tiny", tenant="victim")
            ),
        ),
    ),
    "Router.Status": (
        "router",
        lambda ch: router_pb2_grpc.RouterStub(ch).Status(router_pb2.RouterStatusRequest()),
    ),
    "Router.ListModels": (
        "router",
        lambda ch: router_pb2_grpc.RouterStub(ch).ListModels(gateway_pb2.ListModelsRequest()),
    ),
    "Cache.Store": (
        "cache",
        lambda ch: cache_pb2_grpc.CacheStub(ch).Store(
            cache_pb2.StoreRequest(key=KEY, response=ANSWER)
        ),
    ),
    "Cache.Lookup": (
        "cache",
        lambda ch: cache_pb2_grpc.CacheStub(ch).Lookup(cache_pb2.LookupRequest(key=KEY)),
    ),
    "Cache.Invalidate": (
        "cache",
        lambda ch: cache_pb2_grpc.CacheStub(ch).Invalidate(cache_pb2.InvalidateRequest(all=True)),
    ),
    "Worker.Generate": (
        "worker",
        lambda ch: _stream(
            worker_pb2_grpc.WorkerStub(ch).Generate(),
            worker_pb2.WorkerGenerateMessage(request=request("w", PROMPT, SMALL)),
        ),
    ),
    "Worker.Prefill": (
        "worker",
        lambda ch: worker_pb2_grpc.WorkerStub(ch).Prefill(
            worker_pb2.PrefillRequest(request=request("p", PROMPT, SMALL))
        ),
    ),
    "Worker.PullKv": (
        "worker",
        lambda ch: _stream_unary(
            worker_pb2_grpc.WorkerStub(ch).PullKv(worker_pb2.PullKvRequest(lease_id="x"))
        ),
    ),
    "Worker.ReleaseKv": (
        "worker",
        lambda ch: worker_pb2_grpc.WorkerStub(ch).ReleaseKv(
            worker_pb2.ReleaseKvRequest(lease_id="x")
        ),
    ),
    "Worker.Decode": (
        "worker",
        lambda ch: _stream(
            worker_pb2_grpc.WorkerStub(ch).Decode(),
            worker_pb2.DecodeMessage(start=worker_pb2.DecodeRequest(request=request("d", PROMPT))),
        ),
    ),
    "Worker.Stats": (
        "worker",
        lambda ch: worker_pb2_grpc.WorkerStub(ch).Stats(
            worker_pb2.StatsRequest(include_block_hashes=True)
        ),
    ),
}


async def _stream_unary(call: Any) -> list[Any]:
    return [item async for item in call]


async def _status(stack: Stack, rpc: str, caller: MeshMember | None) -> grpc.StatusCode:
    service, call = RPCS[rpc]
    async with stack.channel(service, caller) as channel:
        try:
            await call(channel)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("caller", OUTSIDERS)
async def test_every_internal_rpc_refuses_an_outsider(
    stack: Stack, caller: MeshMember | None
) -> None:
    for rpc in RPCS:
        assert await _status(stack, rpc, caller) == grpc.StatusCode.UNAUTHENTICATED, rpc
    # Nothing changed: the pools, the cache, the worker (no request ran, no lease).
    async with stack.channel("router", OPERATOR) as channel:
        status = await router_pb2_grpc.RouterStub(channel).Status(router_pb2.RouterStatusRequest())
    assert [w.address for pool in status.pools for w in pool.workers] == [stack.worker.address]
    async with stack.channel("cache", GATEWAY) as channel:
        stats = await cache_pb2_grpc.CacheStub(channel).Stats(cache_pb2.CacheStatsRequest())
    assert stats.entries == 0
    assert (await stack.worker.stats()).active_leases == 0


# Members whose role may not call the RPC (gateway: router and cache; router: workers;
# workers: PullKv/ReleaseKv of workers; operator: the router's pools).
REFUSED_ROLES = [
    ("Router.AddWorker", GATEWAY),
    ("Router.RemoveWorker", WORKER),
    ("Router.Generate", WORKER),
    ("Router.Generate", OPERATOR),
    ("Cache.Store", ROUTER),
    ("Cache.Invalidate", OPERATOR),
    ("Cache.Lookup", WORKER),
    ("Worker.Prefill", GATEWAY),
    ("Worker.Generate", WORKER),
    ("Worker.Decode", OPERATOR),
    ("Worker.Stats", GATEWAY),
    ("Worker.Stats", WORKER),
]


@pytest.mark.parametrize(("rpc", "caller"), REFUSED_ROLES, ids=lambda v: getattr(v, "role", v))
async def test_a_member_may_call_only_what_its_role_needs(
    stack: Stack, rpc: str, caller: MeshMember
) -> None:
    assert await _status(stack, rpc, caller) == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("caller", [WORKER, None], ids=["wrong-role", "no-identity"])
async def test_a_refused_stream_gets_its_status_when_the_first_write_comes_late(
    stack: Stack, caller: MeshMember | None
) -> None:
    """The refusal waits for the caller's first message: a refusal racing that write left
    the client's grpc with INTERNAL instead (seen in CI), and a write after it ended the call
    raised InvalidStateError."""
    expected = (
        grpc.StatusCode.UNAUTHENTICATED if caller is None else grpc.StatusCode.PERMISSION_DENIED
    )
    async with stack.channel("worker", caller) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Generate()
        await asyncio.sleep(0.2)  # the refusal, without the wait, is long sent
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _stream(call, worker_pb2.WorkerGenerateMessage(request=request("w", PROMPT)))
    assert refused.value.code() == expected


async def test_the_members_of_the_stack_get_through(stack: Stack) -> None:
    for rpc, caller in (
        ("Router.Status", OPERATOR),
        ("Router.ListModels", GATEWAY),
        ("Cache.Lookup", GATEWAY),
        ("Worker.Stats", ROUTER),
        ("Worker.Generate", ROUTER),
    ):
        assert await _status(stack, rpc, caller) == grpc.StatusCode.OK, rpc
    # A worker may pull: the guard lets it through to the lease table, which knows no lease x.
    assert await _status(stack, "Worker.PullKv", WORKER) == grpc.StatusCode.NOT_FOUND
    # The router calls its worker as a member: a request through the router completes.
    async with stack.channel("router", GATEWAY) as channel:
        result = await route(
            router_pb2_grpc.RouterStub(channel), request("ok", PROMPT, SMALL, model="tiny")
        )
    assert len(result.token_ids) == SMALL.max_tokens


@pytest.mark.parametrize("service", ["router", "cache", "worker"])
async def test_health_answers_anyone(stack: Stack, service: str) -> None:
    async with stack.channel(service, None) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
