"""The split path's calls to the workers, against stand-in stubs: when the Decode call opens,
what it is sent, and what is cancelled or released when something fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from kvmesh.errors import Unavailable
from kvmesh.v1 import common_pb2, worker_pb2
from services.router.orchestrator import Orchestrator
from tests.unit.router.factories import healthy, registry, tier

PREFILL, DECODE = "prefill:1", "decode:1"
LEASE = common_pb2.KvLease(lease_id="lease-1", worker_address=PREFILL, num_tokens=3)
FIRST = common_pb2.TokenChunk(token_ids=[7])


@dataclass
class FakeDecodeCall:
    """A Decode call: records what is written; streams `events` once the start arrived."""

    events: list[common_pb2.GenerateEvent]
    written: list[worker_pb2.DecodeMessage] = field(default_factory=list)
    cancelled: bool = False
    _started: asyncio.Event = field(default_factory=asyncio.Event)

    async def write(self, message: worker_pb2.DecodeMessage) -> None:
        self.written.append(message)
        self._started.set()

    async def done_writing(self) -> None:
        return None

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    async def _stream(self) -> AsyncIterator[common_pb2.GenerateEvent]:
        await self._started.wait()
        for event in self.events:
            yield event

    def __aiter__(self) -> AsyncIterator[common_pb2.GenerateEvent]:
        return self._stream()


@dataclass
class FakeWorkers:
    """Both workers' stubs: Prefill answers when the test resolves `prefill`."""

    prefill: asyncio.Future[worker_pb2.PrefillResponse]
    decode_events: list[common_pb2.GenerateEvent]
    decode_calls: list[FakeDecodeCall] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    def worker(self, address: str, traced: bool = True) -> Any:
        return self

    def Prefill(
        self, request: worker_pb2.PrefillRequest, timeout: float | None
    ) -> Awaitable[worker_pb2.PrefillResponse]:
        return asyncio.shield(self.prefill)

    def Decode(self, timeout: float | None) -> FakeDecodeCall:
        call = FakeDecodeCall(self.decode_events)
        self.decode_calls.append(call)
        return call

    def ReleaseKv(
        self, request: worker_pb2.ReleaseKvRequest, timeout: float
    ) -> Awaitable[worker_pb2.ReleaseKvResponse]:
        self.released.append(request.lease_id)
        return asyncio.sleep(0, worker_pb2.ReleaseKvResponse(blocks_released=1))


class NoMonitor:
    async def check_many(self, addresses: list[str]) -> None:
        return None


def orchestrator(workers: FakeWorkers) -> Orchestrator:
    pools = registry(tier("t", prefill=(PREFILL,), decode=(DECODE,)))
    healthy(pools, PREFILL)
    healthy(pools, DECODE)
    return Orchestrator(pools, workers, NoMonitor(), load_cost_tokens=0)  # type: ignore[arg-type]


def inference_request() -> common_pb2.InferenceRequest:
    return common_pb2.InferenceRequest(request_id="r", model="t", prompt_token_ids=[1, 2, 3])


async def run(orchestrator: Orchestrator) -> list[common_pb2.GenerateEvent]:
    events = orchestrator.run(inference_request(), None, asyncio.Event(), set())
    return [event async for event in events]


async def test_the_decode_call_opens_while_the_prompt_runs() -> None:
    finished = common_pb2.Finished(finish_reason=common_pb2.FINISH_REASON_LENGTH)
    workers = FakeWorkers(
        asyncio.get_running_loop().create_future(),
        [common_pb2.GenerateEvent(chunk=FIRST), common_pb2.GenerateEvent(finished=finished)],
    )
    running = asyncio.ensure_future(run(orchestrator(workers)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not workers.prefill.done()
    (call,) = workers.decode_calls  # open before the Prefill answered ...
    assert call.written == []  # ... but the start waits for the lease

    workers.prefill.set_result(worker_pb2.PrefillResponse(first_token=FIRST, lease=LEASE))
    events = await running
    assert [e.WhichOneof("event") for e in events] == ["started", "chunk", "finished"]
    (start,) = call.written
    assert start.start.lease == LEASE and start.start.first_token == FIRST
    assert start.start.request.request_id == "r"
    assert workers.released == []  # the decode worker releases the lease it pulled


async def test_a_failed_prefill_cancels_the_open_decode_call() -> None:
    workers = FakeWorkers(asyncio.get_running_loop().create_future(), [])
    workers.prefill.set_exception(
        grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone"
        )
    )
    with pytest.raises(Unavailable, match="gone"):
        await run(orchestrator(workers))
    assert len(workers.decode_calls) == 2  # the first try and the retry
    assert all(call.cancelled and call.written == [] for call in workers.decode_calls)
    assert workers.released == []


async def test_a_request_ended_by_its_first_token_cancels_the_decode_call() -> None:
    finished = common_pb2.Finished(finish_reason=common_pb2.FINISH_REASON_STOP)
    workers = FakeWorkers(asyncio.get_running_loop().create_future(), [])
    workers.prefill.set_result(worker_pb2.PrefillResponse(first_token=FIRST, finished=finished))
    events = await run(orchestrator(workers))
    assert [e.WhichOneof("event") for e in events] == ["started", "chunk", "finished"]
    (call,) = workers.decode_calls
    assert call.cancelled and call.written == []


async def test_a_decode_that_never_starts_releases_the_lease() -> None:
    workers = FakeWorkers(asyncio.get_running_loop().create_future(), [])  # ends at once
    workers.prefill.set_result(worker_pb2.PrefillResponse(first_token=FIRST, lease=LEASE))
    with pytest.raises(Unavailable):
        await run(orchestrator(workers))
    await asyncio.sleep(0.01)  # releases run in the background
    assert workers.released == ["lease-1", "lease-1"]
    assert all(call.cancelled for call in workers.decode_calls)
