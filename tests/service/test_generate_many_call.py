"""GenerateManyCall against a real worker: an idle call stays open a while for the caller's
next request, and a draining worker ends it instead of waiting out its grace."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvmesh.errors import Unavailable
from kvmesh.generate_many import GenerateManyCall, Generation
from kvmesh.v1 import common_pb2
from tests.service.worker_mesh import (
    InProcessWorker,
    all_idle,
    request,
    sampled,
    start_worker,
)

PROMPTS = [list(range(20, 60)), list(range(300, 321))]
LONG = sampled(max_tokens=400)
GRACE_S = 20.0
"""The worker's drain grace: a stop that took it would mean an idle call held the drain."""


@pytest.fixture
async def worker(tiny_llama_dir: Path) -> AsyncIterator[InProcessWorker]:
    started = await start_worker(tiny_llama_dir, "colocated", "--grace-s", str(GRACE_S))
    yield started
    await started.stop()


def open_call(
    worker: InProcessWorker, linger_s: float
) -> GenerateManyCall[common_pb2.GenerateManyMessage]:
    return GenerateManyCall(
        worker.stub.GenerateMany, common_pb2.GenerateManyMessage, "the worker", linger_s
    )


def generate(
    call: GenerateManyCall[common_pb2.GenerateManyMessage],
    request_id: str,
    prompt: list[int],
    sampling: common_pb2.SamplingParams = LONG,
) -> Generation:
    opening = common_pb2.GenerateManyMessage(request=request(request_id, prompt, sampling))
    return call.generate(opening, 30.0)


async def finish_reason(generation: Generation) -> int:
    events = [event async for event in generation.events()]
    return events[-1].finished.finish_reason


async def test_the_next_request_rides_the_idle_call_until_it_has_lingered(
    worker: InProcessWorker,
) -> None:
    call = open_call(worker, linger_s=0.5)
    first = await finish_reason(generate(call, "first", PROMPTS[0]))
    assert call.takes_more and not call.ended.done()
    second = await finish_reason(generate(call, "second", PROMPTS[1]))
    assert first == second == common_pb2.FINISH_REASON_LENGTH
    assert call.takes_more
    await asyncio.wait_for(asyncio.shield(call.ended), 5.0)  # half-closed, then ended
    assert not call.takes_more
    assert await all_idle([worker.stub])


async def test_a_draining_worker_ends_an_idle_call_at_once(worker: InProcessWorker) -> None:
    call = open_call(worker, linger_s=60.0)
    assert await finish_reason(generate(call, "before", PROMPTS[0])) == (
        common_pb2.FINISH_REASON_LENGTH
    )
    assert call.takes_more
    await asyncio.wait_for(worker.worker.server.stop(), GRACE_S / 2)
    assert call.ended.done() and not call.takes_more


async def test_a_draining_worker_finishes_what_runs_and_refuses_what_comes(
    worker: InProcessWorker,
) -> None:
    server = worker.worker.server
    server.shutdown_delay_s = 0.0
    call = open_call(worker, linger_s=60.0)
    running = generate(call, "running", PROMPTS[0])
    first = await running.next_event()  # its first token: it is in the batch
    assert first is not None
    stopping = asyncio.create_task(server.stop())
    await asyncio.sleep(0.05)  # past the health change: grpc takes no new calls
    late = generate(call, "late", PROMPTS[1])
    with pytest.raises(Unavailable, match="draining"):
        await late.next_event()
    events = [first, *[event async for event in running.events()]]
    tokens = [t for event in events if event.HasField("chunk") for t in event.chunk.token_ids]
    assert len(tokens) == LONG.max_tokens  # not cut by the drain
    assert events[-1].finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    await asyncio.wait_for(stopping, GRACE_S / 2)
    assert call.ended.done()
