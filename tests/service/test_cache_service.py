"""The cache service over gRPC, on memory and on a real Redis; Redis down means misses."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from kvmesh.config import load_config
from kvmesh.v1 import cache_pb2, cache_pb2_grpc, common_pb2
from services.cache.__main__ import build_server
from services.cache.config import CacheConfig


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def request_key(tokens: list[int], tenant: str = "acme") -> cache_pb2.CacheKey:
    return cache_pb2.CacheKey(
        model="tiny",
        model_fingerprint="f0",
        prompt_token_ids=tokens,
        sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.0),
        tenant=tenant,
    )


ANSWER = cache_pb2.CachedResponse(
    token_ids=[7, 8, 9], text="abc", finish_reason=common_pb2.FINISH_REASON_STOP, model="tiny"
)


async def cache_stub(args: list[str]) -> AsyncIterator[cache_pb2_grpc.CacheStub]:
    server = build_server(load_config(CacheConfig, ["--port", "0", "--metrics-port", "-1", *args]))
    await server.start()
    async with grpc.aio.insecure_channel(server.address) as channel:
        yield cache_pb2_grpc.CacheStub(channel)
    await server.stop(0)


@pytest.fixture(params=["memory", "redis"])
async def stub(request: pytest.FixtureRequest) -> AsyncIterator[cache_pb2_grpc.CacheStub]:
    args = []
    if request.param == "redis":
        args = ["--redis", "redis://127.0.0.1:6379/0", "--key-prefix", f"test:{uuid.uuid4()}:"]
    async for s in cache_stub(args):
        yield s
        await s.Invalidate(cache_pb2.InvalidateRequest(all=True))


async def test_miss_store_hit_invalidate(stub: cache_pb2_grpc.CacheStub) -> None:
    key = request_key([1, 2, 3])
    assert not (await stub.Lookup(cache_pb2.LookupRequest(key=key))).hit
    stored = await stub.Store(cache_pb2.StoreRequest(key=key, response=ANSWER))
    assert stored.stored, stored.reason
    hit = await stub.Lookup(cache_pb2.LookupRequest(key=key))
    assert hit.hit and list(hit.response.token_ids) == [7, 8, 9] and hit.response.text == "abc"
    other_tenant = await stub.Lookup(cache_pb2.LookupRequest(key=request_key([1, 2, 3], "globex")))
    assert not other_tenant.hit
    stats = await stub.Stats(cache_pb2.CacheStatsRequest())
    assert (stats.hits, stats.misses, stats.stores, stats.entries) == (1, 2, 1, 1)
    removed = await stub.Invalidate(cache_pb2.InvalidateRequest(model="tiny"))
    assert removed.removed == 1
    assert not (await stub.Lookup(cache_pb2.LookupRequest(key=key))).hit


async def test_sampled_request_is_refused(stub: cache_pb2_grpc.CacheStub) -> None:
    key = request_key([4])
    key.sampling.temperature = 0.9
    reply = await stub.Store(cache_pb2.StoreRequest(key=key, response=ANSWER))
    assert not reply.stored and "not deterministic" in reply.reason


async def test_bad_key_is_invalid_argument(stub: cache_pb2_grpc.CacheStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Lookup(cache_pb2.LookupRequest(key=cache_pb2.CacheKey(model="tiny")))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "key.prompt_token_ids" in (caught.value.details() or "")
    assert (await stub.Stats(cache_pb2.CacheStatsRequest())).backend in ("memory", "redis")


@pytest.fixture
def private_redis() -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A redis-server of this test's own, so stopping it harms nobody."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (.ci/run installs it)")
    port = free_port()
    proc = start_redis(binary, port)
    yield port, proc
    proc.terminate()
    proc.wait()


def start_redis(binary: str, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


async def test_redis_down_means_misses_and_recovery_resumes_hits(
    private_redis: tuple[int, subprocess.Popen[bytes]],
) -> None:
    port, proc = private_redis
    url = f"redis://127.0.0.1:{port}/0"
    async for stub in cache_stub(["--redis", url, "--redis-retry-s", "0.2"]):
        key = request_key([9, 9])
        assert (await stub.Store(cache_pb2.StoreRequest(key=key, response=ANSWER))).stored
        assert (await stub.Lookup(cache_pb2.LookupRequest(key=key))).hit
        proc.terminate()
        proc.wait()
        started = time.monotonic()
        for _ in range(5):
            assert not (await stub.Lookup(cache_pb2.LookupRequest(key=key))).hit
        assert time.monotonic() - started < 2.0, "a dead Redis must not stall lookups"
        refused = await stub.Store(cache_pb2.StoreRequest(key=key, response=ANSWER))
        assert not refused.stored and refused.reason == "backend unavailable"
        restarted = start_redis(shutil.which("redis-server") or "redis-server", port)
        try:
            await asyncio.sleep(0.3)  # past redis_retry_s: the cache tries Redis again
            assert (await stub.Store(cache_pb2.StoreRequest(key=key, response=ANSWER))).stored
            assert (await stub.Lookup(cache_pb2.LookupRequest(key=key))).hit
        finally:
            restarted.terminate()
            restarted.wait()
