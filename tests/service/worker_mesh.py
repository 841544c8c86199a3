"""Helpers for worker and router tests: in-process workers, streams, settling checks."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.rpc import status_pb2

from kvmesh.channels import member_channel
from kvmesh.config import load_config
from kvmesh.mesh_auth import MeshMember
from kvmesh.rpc_status import error_from_status
from kvmesh.v1 import (
    common_pb2,
    gateway_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.worker.__main__ import Worker, build_worker
from services.worker.config import WorkerConfig
from services.worker.convert import sampling_params
from services.worker.engine.llm import LLM

Message = common_pb2.GenerateManyMessage | gateway_pb2.GenerateManyClientMessage
"""What a GenerateMany call takes: the gateway's from clients, or the one below it."""

KV_BLOCKS = 64
"""KV pool of every test worker: small, so a leaked block shows."""

GREEDY = common_pb2.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SEEDED = common_pb2.SamplingParams(
    max_tokens=10, temperature=0.9, top_k=50, top_p=0.95, seed=1234, ignore_eos=True
)


def worker_args(model: Path, role: str, *extra: str) -> list[str]:
    """Flags of a small test worker."""
    return [
        "--role",
        role,
        "--model",
        str(model),
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--num-kv-blocks",
        str(KV_BLOCKS),
        "--num-threads",
        "1",
        "--lease-sweep-interval-s",
        "0.05",
        *extra,
    ]


@dataclass
class InProcessWorker:
    """A started in-process worker and a channel to it."""

    worker: Worker
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub = field(init=False)

    def __post_init__(self) -> None:
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)

    @property
    def address(self) -> str:
        return self.worker.server.address

    async def stats(self) -> worker_pb2.WorkerStats:
        return await self.stub.Stats(worker_pb2.StatsRequest(), timeout=5)

    async def stop(self) -> None:
        await self.channel.close()
        await self.worker.stop()


async def start_worker(
    model: Path, role: str, *extra: str, caller: MeshMember | None = None
) -> InProcessWorker:
    """Builds and starts a worker on a free port; the test's channel to it calls as `caller`
    (a member of the worker's stack, when it has a mesh secret)."""
    worker = build_worker(load_config(WorkerConfig, worker_args(model, role, *extra)))
    await worker.start()
    return InProcessWorker(worker, member_channel(worker.server.address, caller))


def request(
    request_id: str,
    prompt: Sequence[int],
    sampling: common_pb2.SamplingParams = GREEDY,
    model: str = "tiny",
    **fields: object,
) -> common_pb2.InferenceRequest:
    return common_pb2.InferenceRequest(
        request_id=request_id,
        model=model,
        prompt_token_ids=list(prompt),
        sampling=sampling,
        **fields,  # type: ignore[arg-type]
    )


@dataclass
class StreamResult:
    """Everything a generation stream delivered."""

    events: list[common_pb2.GenerateEvent]

    @property
    def chunks(self) -> list[common_pb2.TokenChunk]:
        return [e.chunk for e in self.events if e.WhichOneof("event") == "chunk"]

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def started(self) -> common_pb2.Started:
        first = self.events[0]
        assert first.WhichOneof("event") == "started", first
        return first.started

    @property
    def finished(self) -> common_pb2.Finished:
        last = self.events[-1]
        assert last.WhichOneof("event") == "finished", last
        return last.finished


async def collect(call: grpc.aio.StreamStreamCall) -> StreamResult:
    return StreamResult([event async for event in call])


async def colocated(
    stub: worker_pb2_grpc.WorkerStub, req: common_pb2.InferenceRequest
) -> StreamResult:
    call = stub.Generate(timeout=30)
    await call.write(worker_pb2.WorkerGenerateMessage(request=req))
    return await collect(call)


def prefill_request(
    req: common_pb2.InferenceRequest, puller: InProcessWorker, lease_ttl_ms: int = 0
) -> worker_pb2.PrefillRequest:
    """A Prefill whose lease `puller` may pull (as the router names its decode worker)."""
    return worker_pb2.PrefillRequest(request=req, lease_ttl_ms=lease_ttl_ms, puller=puller.address)


async def disaggregated(
    prefill: InProcessWorker,
    decode: InProcessWorker,
    req: common_pb2.InferenceRequest,
    lease_ttl_ms: int = 0,
) -> StreamResult:
    """Prefill on one worker, Decode on the other (as the router does)."""
    prefilled = await prefill.stub.Prefill(prefill_request(req, decode, lease_ttl_ms), timeout=30)
    assert not prefilled.HasField("finished")
    call = decode.stub.Decode(timeout=30)
    await call.write(decode_start(req, prefilled))
    return await collect(call)


def decode_start(
    req: common_pb2.InferenceRequest, prefilled: worker_pb2.PrefillResponse
) -> worker_pb2.DecodeMessage:
    return worker_pb2.DecodeMessage(
        start=worker_pb2.DecodeRequest(
            request=req,
            lease=prefilled.lease,
            first_token=prefilled.first_token,
            sampled=prefilled.sampled,
        )
    )


async def route(
    stub: router_pb2_grpc.RouterStub, req: common_pb2.InferenceRequest, limit_s: float = 30
) -> StreamResult:
    call = stub.Generate(timeout=limit_s)
    await call.write(router_pb2.RouteMessage(request=req))
    return await collect(call)


class ManyStream:
    """A GenerateMany call (a worker's or the router's): messages go in by `send`, events come
    out by generation."""

    def __init__(
        self,
        start: Callable[..., grpc.aio.StreamStreamCall],
        message_type: Callable[..., Message] = common_pb2.GenerateManyMessage,
    ) -> None:
        self._message_type = message_type
        self._outbox: asyncio.Queue[Message | None] = asyncio.Queue()
        self.call = start(self._messages(), timeout=60)
        self.events: dict[int, list[common_pb2.GenerateEvent]] = defaultdict(list)
        self.errors: dict[int, status_pb2.Status] = {}
        self.messages = 0

    async def _messages(self) -> AsyncIterator[Message]:
        while (message := await self._outbox.get()) is not None:
            yield message

    def send(self, stream_id: int, **fields: object) -> None:
        message = self._message_type(stream_id=stream_id, **fields)
        self._outbox.put_nowait(message)

    def half_close(self) -> None:
        self._outbox.put_nowait(None)

    async def read_until(self, done: set[int]) -> None:
        """Reads until every generation in `done` has ended (Finished or an error)."""
        while not done <= self.ended:
            message = await self.call.read()
            assert message is not grpc.aio.EOF, "the stream ended with generations open"
            self.messages += 1
            for item in message.events:
                if item.WhichOneof("outcome") == "error":
                    self.errors[item.stream_id] = status_pb2.Status.FromString(item.error)
                else:
                    self.events[item.stream_id].append(item.event)

    @property
    def ended(self) -> set[int]:
        finished = {
            i for i, events in self.events.items() if events[-1].WhichOneof("event") == "finished"
        }
        return finished | set(self.errors)

    def token_ids(self, stream_id: int) -> list[int]:
        events = self.events[stream_id]
        return [t for e in events if e.WhichOneof("event") == "chunk" for t in e.chunk.token_ids]

    def finish_reason(self, stream_id: int) -> int:
        return self.events[stream_id][-1].finished.finish_reason


async def route_many(
    stub: router_pb2_grpc.RouterStub, req: common_pb2.InferenceRequest, limit_s: float = 30
) -> StreamResult:
    """`req` alone on a Router.GenerateMany stream, with `limit_s` as its timeout: its events;
    the error that ended it raised as its KvmeshError."""
    stream = ManyStream(stub.GenerateMany)
    stream.send(1, request=req, timeout_ms=round(limit_s * 1000))
    try:
        await stream.read_until({1})
    finally:
        stream.half_close()
    if 1 in stream.errors:
        raise error_from_status(stream.errors[1])
    return StreamResult(stream.events[1])


def offline(
    model: Path, prompts: Sequence[Sequence[int]], sampling: common_pb2.SamplingParams
) -> list[list[int]]:
    """The engine's offline output for each prompt (the reference every path must match)."""
    llm = LLM(str(model), num_kv_blocks=KV_BLOCKS, num_threads=1)
    params = sampling_params(sampling)
    return [c.token_ids for c in llm.generate([list(p) for p in prompts], params)]


async def wait_until(
    check: Callable[[], Awaitable[bool]], within: float = 5.0, interval: float = 0.05
) -> bool:
    """Polls `check` until it holds or `within` seconds pass; returns the last result."""
    deadline = time.monotonic() + within
    while True:
        if await check():
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval)


def idle(stats: worker_pb2.WorkerStats) -> bool:
    """No request, no lease, every KV block free (cached blocks count as free)."""
    return (
        stats.running == 0
        and stats.waiting == 0
        and stats.active_leases == 0
        and stats.kv_blocks_free == stats.kv_blocks_total
    )


async def all_idle(stubs: Sequence[worker_pb2_grpc.WorkerStub], within: float = 5.0) -> bool:
    """Waits until every worker is idle; False (with the offenders printed) when not."""

    async def check() -> bool:
        stats = [await s.Stats(worker_pb2.StatsRequest(), timeout=5) for s in stubs]
        return all(idle(s) for s in stats)

    settled = await wait_until(check, within)
    if not settled:
        for stub in stubs:
            print(await stub.Stats(worker_pb2.StatsRequest(), timeout=5))
    return settled


async def prompt_whose_first_two_tokens_have_text(
    stub: worker_pb2_grpc.WorkerStub,
) -> tuple[list[int], list[str]]:
    """A prompt of the tiny random model whose first and second greedy tokens each add text
    (many of its tokens are partial characters), and texts[n]: its first n tokens' text."""
    for start in range(20, 2000, 37):
        prompt = list(range(start, start + 30))
        texts = [""]
        for n in (1, 2, 3):
            result = await colocated(stub, request(f"t{start}-{n}", prompt, sampled(max_tokens=n)))
            texts.append(result.text)
        if texts[1] and len(texts[2]) > len(texts[1]):
            return prompt, texts
    raise AssertionError("no prompt of the tiny model starts with two tokens of text")


def sampled(**fields: int | list[str] | list[int]) -> common_pb2.SamplingParams:
    """GREEDY with some fields set (max_tokens) or extended (stop, stop_token_ids)."""
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(GREEDY)
    for name, value in fields.items():
        if isinstance(value, int):
            setattr(sampling, name, value)
        else:
            getattr(sampling, name).extend(value)
    return sampling
