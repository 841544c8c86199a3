"""A worker defends itself, against callers outside the stack and members gone wrong (issue 15):
forged leases are refused before anything is dialled, forged KV never reaches the prefix cache,
the lease TTL is the worker's, a lease serves only its holders, pulls are bounded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvmesh.channels import member_channel
from kvmesh.config import load_config
from kvmesh.grpc_server import GrpcServer, ServiceBinding
from kvmesh.mesh_auth import (
    NAME_METADATA,
    ROLE_METADATA,
    ROUTER_MEMBER_NAME,
    TOKEN_METADATA,
    MeshMember,
    MeshRole,
)
from kvmesh.mesh_keys import MeshKeys
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker import kv_exporter
from services.worker.config import WorkerConfig
from services.worker.kv_transfer import crc32c
from tests.service.worker_mesh import (
    GREEDY,
    InProcessWorker,
    all_idle,
    collect,
    decode_start,
    offline,
    request,
    start_worker,
)

SECRET = "the test stack's secret"
KEYS = MeshKeys.from_secret(SECRET)
ROUTER = MeshMember(MeshRole.ROUTER, ROUTER_MEMBER_NAME, KEYS)
"""Every test stub of the workers calls as the stack's router does."""
PROMPT = list(range(20, 60))  # 40 tokens: 3 blocks of 16
_MEMBER_METADATA = (ROLE_METADATA, NAME_METADATA, TOKEN_METADATA)

Tamper = Callable[[common_pb2.KvChunk], common_pb2.KvChunk]


def _unchanged(chunk: common_pb2.KvChunk) -> common_pb2.KvChunk:
    return chunk


class Relay(worker_pb2_grpc.WorkerServicer):
    """The network between two workers: relays PullKv and ReleaseKv to the prefill worker
    with the caller's identity, passing each chunk through `tamper` (a man in the middle)."""

    def __init__(self) -> None:
        self.target: worker_pb2_grpc.WorkerStub | None = None
        self.tamper: Tamper = _unchanged

    @staticmethod
    def _identity(context: grpc.aio.ServicerContext) -> list[tuple[str, str]]:
        return [(k, v) for k, v in context.invocation_metadata() or () if k in _MEMBER_METADATA]

    async def PullKv(
        self, request: worker_pb2.PullKvRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvChunk]:
        assert self.target is not None
        async for chunk in self.target.PullKv(request, metadata=self._identity(context)):
            yield self.tamper(chunk)

    async def ReleaseKv(
        self, request: worker_pb2.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseKvResponse:
        assert self.target is not None
        return await self.target.ReleaseKv(request, metadata=self._identity(context))


@dataclass
class Stack:
    """A prefill and a decode worker of one stack, the prefill reached through `relay`; the
    workers' stubs call as the stack's router."""

    prefill: InProcessWorker
    decode: InProcessWorker
    relay: Relay

    async def prefill_for_decode(
        self, req: common_pb2.InferenceRequest, lease_ttl_ms: int = 0
    ) -> worker_pb2.PrefillResponse:
        return await self.prefill.stub.Prefill(
            worker_pb2.PrefillRequest(
                request=req, lease_ttl_ms=lease_ttl_ms, puller=self.decode.address
            ),
            timeout=30,
        )

    async def decode_error(self, message: worker_pb2.DecodeMessage) -> grpc.aio.AioRpcError:
        call = self.decode.stub.Decode(timeout=10)
        await call.write(message)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            _ = [event async for event in call]
        return raised.value


def member_stub(
    address: str, role: MeshRole, name: str, keys: MeshKeys = KEYS
) -> worker_pb2_grpc.WorkerStub:
    """A stub that calls as the member `role`/`name`, with a token made from `keys`."""
    return worker_pb2_grpc.WorkerStub(member_channel(address, MeshMember(role, name, keys)))


@pytest.fixture
async def stack(tiny_llama_dir: Path, tmp_path: Path) -> AsyncIterator[Stack]:
    relay = Relay()  # type: ignore[abstract]  # serves PullKv and ReleaseKv only
    config = load_config(WorkerConfig, ["--port", "0", "--metrics-port", "-1"])
    binding = ServiceBinding(
        "kvmesh.v1.Worker",
        relay,
        worker_pb2_grpc.add_WorkerServicer_to_server,
    )
    relay_server = GrpcServer(config, "relay", [binding])
    await relay_server.start()
    secret_file = tmp_path / "mesh-secret"
    secret_file.write_text(SECRET)
    secret = ("--mesh-secret-file", str(secret_file))
    prefill = await start_worker(
        tiny_llama_dir,
        "prefill",
        *secret,
        "--advertise-address",
        relay_server.address,
        caller=ROUTER,
    )
    decode = await start_worker(tiny_llama_dir, "decode", *secret, caller=ROUTER)
    relay.target = worker_pb2_grpc.WorkerStub(grpc.aio.insecure_channel(prefill.address))
    yield Stack(prefill, decode, relay)
    await asyncio.gather(prefill.stop(), decode.stop(), relay_server.stop(0))


async def _listener() -> tuple[asyncio.Server, list[int]]:
    """A TCP port that counts the connections made to it."""
    connections: list[int] = []

    def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        writer.close()

    server = await asyncio.start_server(accepted, "127.0.0.1", 0)
    return server, connections


async def test_a_lease_this_stack_did_not_sign_is_refused_with_nothing_dialled(
    stack: Stack,
) -> None:
    server, connections = await _listener()
    trap = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    req = request("victim", PROMPT)
    genuine = await stack.prefill_for_decode(req)

    def forged(address: str, keys: MeshKeys | None) -> worker_pb2.DecodeMessage:
        message = decode_start(req, genuine)
        lease = message.start.lease
        lease.worker_address = address
        lease.signature = keys.sign_lease(lease) if keys is not None else b""
        return message

    other_stack = MeshKeys.from_secret("another stack")
    for message in (
        forged(trap, None),  # the genuine lease, its address changed
        forged(trap, other_stack),  # signed, by a key of another stack
        forged("unix:/tmp/kvmesh-trap.sock", None),
        forged(trap, MeshKeys.from_secret("")),  # signed with the no-secret key
    ):
        error = await stack.decode_error(message)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "signature" in (error.details() or "")
        assert trap not in (error.details() or "")
    await asyncio.sleep(0.1)
    server.close()
    assert connections == []
    assert await all_idle([stack.decode.stub])
    await stack.prefill.stub.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=genuine.lease.lease_id))
    assert await all_idle([stack.prefill.stub])


def _other_bytes(chunk: common_pb2.KvChunk) -> common_pb2.KvChunk:
    """Other KV under the same block hash, with a CRC that matches: only the digest tells."""
    chunk.data = bytes(len(chunk.data))
    chunk.crc32c = crc32c(chunk.data)
    return chunk


def _one_bit_flipped(chunk: common_pb2.KvChunk) -> common_pb2.KvChunk:
    chunk.data = bytes([chunk.data[0] ^ 1]) + chunk.data[1:]
    return chunk


@pytest.mark.parametrize(
    ("tamper", "named"), [(_other_bytes, "digest"), (_one_bit_flipped, "checksum")]
)
async def test_forged_kv_never_reaches_the_prefix_cache(
    stack: Stack, tiny_llama_dir: Path, tamper: Tamper, named: str
) -> None:
    (expected,) = offline(tiny_llama_dir, [PROMPT], GREEDY)
    attack = request("attack", PROMPT)
    prefilled = await stack.prefill_for_decode(attack)
    stack.relay.tamper = tamper
    error = await stack.decode_error(decode_start(attack, prefilled))
    assert error.code() == grpc.StatusCode.DATA_LOSS
    assert named in (error.details() or "")
    stats = await stack.decode.stub.Stats(worker_pb2.StatsRequest(include_block_hashes=True))
    assert not set(prefilled.lease.block_hashes) & set(stats.cached_block_hashes)
    assert await all_idle([stack.decode.stub])
    await stack.prefill.stub.ReleaseKv(
        worker_pb2.ReleaseKvRequest(lease_id=prefilled.lease.lease_id)
    )

    # The victim's own request, after: its KV is pulled afresh and its tokens are the model's.
    stack.relay.tamper = _unchanged
    victim = request("victim", PROMPT)
    prefilled = await stack.prefill_for_decode(victim)
    call = stack.decode.stub.Decode(timeout=30)
    await call.write(decode_start(victim, prefilled))
    result = await collect(call)
    assert result.token_ids == expected
    assert await all_idle([stack.prefill.stub, stack.decode.stub])


async def test_the_lease_ttl_is_the_workers_a_caller_may_only_shorten_it(stack: Stack) -> None:
    asked_at_ms = time.time() * 1000
    longest = await stack.prefill_for_decode(request("long", PROMPT), lease_ttl_ms=2**32 - 1)
    shorter = await stack.prefill_for_decode(request("short", PROMPT), lease_ttl_ms=2_000)
    worker_ttl_ms = stack.prefill.worker.servicer.config.lease_ttl_s * 1000
    assert longest.lease.expires_unix_ms <= asked_at_ms + worker_ttl_ms + 1_000
    assert shorter.lease.expires_unix_ms <= asked_at_ms + 2_000 + 1_000
    for prefilled in (longest, shorter):
        await stack.prefill.stub.ReleaseKv(
            worker_pb2.ReleaseKvRequest(lease_id=prefilled.lease.lease_id)
        )
    assert await all_idle([stack.prefill.stub])


def _pull(lease: common_pb2.KvLease, indices: list[int] | None = None) -> worker_pb2.PullKvRequest:
    return worker_pb2.PullKvRequest(
        lease_id=lease.lease_id,
        block_indices=indices or [],
        model_fingerprint=lease.model_fingerprint,
        layout=lease.layout,
    )


async def _status_of(call: Any) -> grpc.StatusCode:
    """The status a unary or server-streaming call fails with."""
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        if hasattr(call, "__aiter__"):
            _ = [item async for item in call]
        else:
            await call
    return raised.value.code()


async def test_only_the_lease_holders_pull_or_release_it(stack: Stack) -> None:
    prefilled = await stack.prefill_for_decode(request("held", PROMPT))
    lease = prefilled.lease
    release = worker_pb2.ReleaseKvRequest(lease_id=lease.lease_id)
    address = stack.prefill.address
    strangers = [
        # No identity at all: refused by the membership check.
        (worker_pb2_grpc.WorkerStub(grpc.aio.insecure_channel(address)), "UNAUTHENTICATED"),
        # The puller's name with a token another stack's secret made.
        (
            member_stub(address, MeshRole.WORKER, stack.decode.address, MeshKeys.from_secret("x")),
            "UNAUTHENTICATED",
        ),
        # A member whose role may not touch leases.
        (member_stub(address, MeshRole.GATEWAY, "gateway"), "PERMISSION_DENIED"),
        # Another worker of the stack: a member that may pull, but not this lease.
        (member_stub(address, MeshRole.WORKER, "127.0.0.1:1"), "PERMISSION_DENIED"),
    ]
    for stranger, status in strangers:
        assert (await _status_of(stranger.ReleaseKv(release))).name == status
        assert (await _status_of(stranger.PullKv(_pull(lease)))).name == status
    assert (await stack.prefill.stats()).active_leases == 1
    puller = member_stub(address, MeshRole.WORKER, stack.decode.address)
    chunks = [chunk async for chunk in puller.PullKv(_pull(lease))]
    assert sorted({c.block_index for c in chunks}) == [0, 1, 2]
    released = await puller.ReleaseKv(release)
    assert released.blocks_released == 3
    assert await all_idle([stack.prefill.stub])


async def test_a_pull_names_each_block_once_and_in_range(stack: Stack) -> None:
    prefilled = await stack.prefill_for_decode(request("indices", PROMPT))
    puller = member_stub(stack.prefill.address, MeshRole.WORKER, stack.decode.address)
    for indices in ([0, 0], [0] * 100_000, [1, 3], [2**32 - 1]):
        status = await _status_of(puller.PullKv(_pull(prefilled.lease, indices)))
        assert status == grpc.StatusCode.INVALID_ARGUMENT, indices
    chunks = [chunk async for chunk in puller.PullKv(_pull(prefilled.lease, [2, 0]))]
    assert [c.block_index for c in chunks] == [2, 0]
    await stack.prefill.stub.ReleaseKv(
        worker_pb2.ReleaseKvRequest(lease_id=prefilled.lease.lease_id)
    )
    assert await all_idle([stack.prefill.stub])


async def test_a_pull_reads_a_few_blocks_at_a_time(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = stack.prefill.worker.engine
    block_bytes = engine.layout.block_bytes
    monkeypatch.setattr(kv_exporter, "PULL_READ_BYTES", 2 * block_bytes)
    reads: list[int] = []
    export = engine.export_blocks

    async def recorded(handle_id: str, indices: list[int]) -> list[bytes]:
        reads.append(len(indices))
        return await export(handle_id, indices)

    monkeypatch.setattr(engine, "export_blocks", recorded)
    prefilled = await stack.prefill_for_decode(request("big", list(range(20, 120))))  # 7 blocks
    puller = member_stub(stack.prefill.address, MeshRole.WORKER, stack.decode.address)
    chunks = [chunk async for chunk in puller.PullKv(_pull(prefilled.lease))]
    assert reads == [2, 2, 2, 1]  # never more than PULL_READ_BYTES read at once
    assert [c.block_index for c in chunks] == list(range(7))
    assert all(len(c.data) == block_bytes for c in chunks)
    await puller.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=prefilled.lease.lease_id))
    assert await all_idle([stack.prefill.stub])


async def test_every_bound_is_checked_at_the_worker(stack: Stack) -> None:
    """A caller that skips the gateway and router still meets the mesh's bounds."""
    too_many_stops = request(
        "stops", PROMPT, common_pb2.SamplingParams(max_tokens=4, stop=["x"] * 30_000)
    )
    too_many_labels = request("labels", PROMPT, labels={f"k{i}": "v" for i in range(100_000)})
    too_many_tokens = request("long", PROMPT, common_pb2.SamplingParams(max_tokens=2**32 - 1))
    for bad, field in (
        (too_many_stops, "sampling.stop"),
        (too_many_labels, "labels"),
        (too_many_tokens, "sampling.max_tokens"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stack.prefill_for_decode(bad)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (raised.value.details() or "").startswith(field)
        genuine = await stack.prefill_for_decode(request("ok", PROMPT))
        message = decode_start(bad, genuine)
        error = await stack.decode_error(message)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (error.details() or "").startswith(field)
        await stack.prefill.stub.ReleaseKv(
            worker_pb2.ReleaseKvRequest(lease_id=genuine.lease.lease_id)
        )
    assert await all_idle([stack.prefill.stub, stack.decode.stub])
