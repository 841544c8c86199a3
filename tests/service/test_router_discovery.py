"""The router finds its workers through DNS (services/router/discovery.py), as on Kubernetes.

A DNS server on loopback (dnslib) answers for two names the way a headless Service does: one
A record per ready pod. The workers are real in-process workers on the tiny model, each on its
own loopback address (127.0.0.x) and the pool's one port; the router is the real router, asking
that server. Workers added to the answer join the rotation once their health check passes,
workers taken out of it leave (a stream already on one finishes), and prefill and decode
workers of different model revisions are never paired.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml
from dnslib import QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSLogger, DNSServer

from kvmesh.config import load_config
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.__main__ import Router, build_router
from services.router.config import RouterConfig
from services.router.pools import Role
from tests.service.worker_mesh import (
    GREEDY,
    InProcessWorker,
    all_idle,
    offline,
    request,
    route,
    start_worker,
    wait_until,
)

PROMPT = list(range(100, 160))
PREFILL_NAME = "prefill.kvmesh.test"
DECODE_NAME = "decode.kvmesh.test"


class Zone(BaseResolver):  # type: ignore[misc]
    """Answers A queries from a table the test edits; NXDOMAIN for a name it does not hold."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.lock = threading.Lock()

    def set(self, name: str, ips: list[str]) -> None:
        with self.lock:
            self.records[name] = list(ips)

    def resolve(self, query: DNSRecord, handler: DNSHandler) -> DNSRecord:
        reply = query.reply()
        name = str(query.q.qname).rstrip(".")
        with self.lock:
            ips = self.records.get(name)
        if ips is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif query.q.qtype == QTYPE.A:
            for ip in ips:
                reply.add_answer(RR(query.q.qname, QTYPE.A, rdata=A(ip), ttl=0))
        return reply


@pytest.fixture
def zone() -> Iterator[tuple[Zone, int]]:
    """The DNS server on 127.0.0.1 (UDP, a free port) and its zone."""
    records = Zone()
    quiet = DNSLogger(logf=lambda _: None)
    server = DNSServer(records, address="127.0.0.1", port=0, logger=quiet)
    server.start_thread()
    try:
        yield records, server.server.server_address[1]
    finally:
        server.stop()
        server.server.server_close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class Pool:
    """Workers of one pool, all on `port`, each on its own loopback address."""

    model: Path
    role: str
    port: int = field(default_factory=free_port)
    workers: dict[str, InProcessWorker] = field(default_factory=dict)

    async def start(self, ip: str, *extra: str) -> str:
        """Starts a worker on ip:port; returns its address."""
        worker = await start_worker(
            self.model, self.role, "--host", ip, "--port", str(self.port), *extra
        )
        self.workers[ip] = worker
        return worker.address

    def address(self, ip: str) -> str:
        return f"{ip}:{self.port}"

    async def close(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers.values()))


@dataclass
class Mesh:
    zone: Zone
    prefill: Pool
    decode: Pool
    router: Router
    stub: router_pb2_grpc.RouterStub

    async def pools(self) -> dict[str, dict[str, bool]]:
        """The router's Status: each pool's worker addresses and whether each is in rotation."""
        status = await self.stub.Status(router_pb2.RouterStatusRequest(), timeout=5)
        found: dict[str, dict[str, bool]] = {}
        for pool in status.pools:
            role = Role.from_proto(pool.role).value
            found.setdefault(role, {}).update({w.address: w.healthy for w in pool.workers})
        return found

    async def sees(self, role: str, expected: dict[str, bool]) -> bool:
        return (await self.pools()).get(role, {}) == expected


@pytest.fixture
async def mesh(zone: tuple[Zone, int], tiny_llama_dir: Path, tmp_path: Path) -> AsyncIterator[Mesh]:
    records, dns_port = zone
    prefill, decode = Pool(tiny_llama_dir, "prefill"), Pool(tiny_llama_dir, "decode")
    await prefill.start("127.0.0.2")
    await decode.start("127.0.0.3")
    records.set(PREFILL_NAME, ["127.0.0.2"])
    records.set(DECODE_NAME, ["127.0.0.3"])
    pools = tmp_path / "pools.yaml"
    tier = {
        "name": "tiny",
        "prefill": [f"dns:///{PREFILL_NAME}:{prefill.port}"],
        "decode": [f"dns:///{DECODE_NAME}:{decode.port}"],
    }
    pools.write_text(yaml.safe_dump({"tiers": [tier]}))
    args = ["--config", str(pools), "--port", "0", "--metrics-port", "-1"]
    args += ["--refresh-interval-s", "0.1", "--dns-interval-s", "0.1"]
    args += ["--dns-server", f"127.0.0.1:{dns_port}"]
    router = build_router(load_config(RouterConfig, args))
    await router.start()
    channel = grpc.aio.insecure_channel(router.server.address)
    try:
        yield Mesh(records, prefill, decode, router, router_pb2_grpc.RouterStub(channel))
    finally:
        await channel.close()
        await router.stop()
        await prefill.close()
        await decode.close()


async def test_workers_named_by_dns_serve_and_equal_offline(
    mesh: Mesh, tiny_llama_dir: Path
) -> None:
    assert await mesh.pools() == {
        "prefill": {mesh.prefill.address("127.0.0.2"): True},
        "decode": {mesh.decode.address("127.0.0.3"): True},
    }
    (expected,) = offline(tiny_llama_dir, [PROMPT], GREEDY)
    result = await route(mesh.stub, request("dns", PROMPT))
    assert result.token_ids == expected
    assert result.started.placement.prefill_worker == mesh.prefill.address("127.0.0.2")
    assert result.started.placement.decode_worker == mesh.decode.address("127.0.0.3")


async def test_a_new_address_joins_after_its_health_check_and_a_vanished_one_leaves(
    mesh: Mesh,
) -> None:
    first, second, dead = "127.0.0.2", "127.0.0.4", "127.0.0.5"
    await mesh.prefill.start(second)
    # 127.0.0.5 is in the answer but nothing listens there: listed, never in rotation.
    mesh.zone.set(PREFILL_NAME, [first, second, dead])
    address = mesh.prefill.address
    both = {address(first): True, address(second): True, address(dead): False}
    assert await wait_until(lambda: mesh.sees("prefill", both))
    used = set()
    for i in range(6):
        result = await route(mesh.stub, request(f"spread-{i}", PROMPT))
        used.add(result.started.placement.prefill_worker)
    assert address(dead) not in used

    mesh.zone.set(PREFILL_NAME, [second])
    assert await wait_until(lambda: mesh.sees("prefill", {address(second): True}))
    for i in range(3):
        result = await route(mesh.stub, request(f"after-{i}", PROMPT))
        assert result.started.placement.prefill_worker == address(second)
    # A name that no longer exists empties its pool: nothing is placed on stale addresses.
    del mesh.zone.records[PREFILL_NAME]
    assert await wait_until(lambda: mesh.sees("prefill", {}))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await route(mesh.stub, request("none", PROMPT))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_stream_on_a_worker_that_leaves_the_answer_finishes(
    mesh: Mesh, tiny_llama_dir: Path
) -> None:
    await mesh.decode.start("127.0.0.6")
    mesh.zone.set(DECODE_NAME, ["127.0.0.3", "127.0.0.6"])
    address = mesh.decode.address
    assert await wait_until(
        lambda: mesh.sees("decode", {address("127.0.0.3"): True, address("127.0.0.6"): True})
    )
    # Eight long streams (the tiny model's whole context) keep both decode workers busy.
    long = common_pb2.SamplingParams(max_tokens=440, temperature=0.0, ignore_eos=True)
    (expected,) = offline(tiny_llama_dir, [PROMPT], long)
    calls = [mesh.stub.Generate(timeout=60) for _ in range(8)]
    for i, call in enumerate(calls):
        await call.write(router_pb2.RouteMessage(request=request(f"drain-{i}", PROMPT, long)))
    placed = [(await call.read()).started.placement.decode_worker for call in calls]
    leaving = placed[0]
    staying = next(a for a in (address("127.0.0.3"), address("127.0.0.6")) if a != leaving)
    mesh.zone.set(DECODE_NAME, [staying.split(":")[0]])
    assert await wait_until(lambda: mesh.sees("decode", {staying: True}))
    still_running = await mesh.decode.workers[leaving.split(":")[0]].stats()
    assert still_running.running > 0, "the streams ended before the worker left: no drain seen"
    # Its channels are out of use at once, and close only once the streams on them end.
    assert not mesh.router.peers.opened(leaving)
    assert mesh.router.peers.closing > 0
    for call in calls:
        tokens = []
        while (event := await call.read()) is not grpc.aio.EOF:
            if event.WhichOneof("event") == "chunk":
                tokens += event.chunk.token_ids
            last = event
        assert tokens == expected
        assert last.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    after = await route(mesh.stub, request("next", PROMPT))
    assert after.started.placement.decode_worker == staying
    assert await all_idle([w.stub for w in mesh.decode.workers.values()])

    async def retired_channels_closed() -> bool:
        return mesh.router.peers.closing == 0

    assert await wait_until(retired_channels_closed)
    assert not mesh.router.peers.opened(leaving)


async def test_prefill_and_decode_of_different_revisions_are_never_paired(
    mesh: Mesh,
) -> None:
    # 127.0.0.7 runs another revision of the tier: int8 weights, another model fingerprint.
    await mesh.decode.start("127.0.0.7", "--quantization", "int8")
    mesh.zone.set(DECODE_NAME, ["127.0.0.3", "127.0.0.7"])
    address = mesh.decode.address
    assert await wait_until(
        lambda: mesh.sees("decode", {address("127.0.0.3"): True, address("127.0.0.7"): True})
    )
    # The int8 worker is idle and so the decode pick on load alone; it is never chosen.
    for i in range(4):
        result = await route(mesh.stub, request(f"rev-{i}", PROMPT))
        assert result.started.placement.decode_worker == address("127.0.0.3")
    mesh.zone.set(DECODE_NAME, ["127.0.0.7"])
    assert await wait_until(lambda: mesh.sees("decode", {address("127.0.0.7"): True}))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await route(mesh.stub, request("mismatch", PROMPT))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert await all_idle([w.stub for w in mesh.decode.workers.values()])
