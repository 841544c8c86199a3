"""Worker.GenerateMany on the tiny model: many colocated generations on one stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from kvmesh.rpc_status import error_from_status
from kvmesh.v1 import common_pb2
from tests.service.worker_mesh import (
    GREEDY,
    InProcessWorker,
    ManyStream,
    all_idle,
    colocated,
    request,
    sampled,
    start_worker,
    wait_until,
)

PROMPTS = [list(range(20, 60)), list(range(300, 321)), list(range(100, 130))]
LONG = sampled(max_tokens=400)


@pytest.fixture
async def worker(tiny_llama_dir: Path) -> AsyncIterator[InProcessWorker]:
    started = await start_worker(tiny_llama_dir, "colocated")
    yield started
    await started.stop()


async def test_generations_on_one_stream_equal_each_alone_and_share_its_messages(
    worker: InProcessWorker,
) -> None:
    alone = [
        (await colocated(worker.stub, request(f"alone-{i}", prompt))).token_ids
        for i, prompt in enumerate(PROMPTS)
    ]
    stream = ManyStream(worker.stub.GenerateMany)
    for i, prompt in enumerate(PROMPTS):
        stream.send(i + 1, request=request(f"many-{i}", prompt), timeout_ms=30_000)
    await stream.read_until({1, 2, 3})
    assert [stream.token_ids(i + 1) for i in range(3)] == alone
    assert all(stream.finish_reason(i) == common_pb2.FINISH_REASON_LENGTH for i in (1, 2, 3))
    events = sum(len(events) for events in stream.events.values())
    # One continuous batch: a step's tokens for all three go out in one message.
    assert stream.messages < events
    stream.half_close()
    assert await stream.call.read() is grpc.aio.EOF
    assert await stream.call.code() == grpc.StatusCode.OK
    assert await all_idle([worker.stub])


async def test_a_cancel_ends_its_generation_alone_and_frees_its_blocks(
    worker: InProcessWorker,
) -> None:
    stream = ManyStream(worker.stub.GenerateMany)
    stream.send(1, request=request("cancelled", PROMPTS[0], LONG))
    stream.send(2, request=request("kept", PROMPTS[1], GREEDY))
    await stream.read_until({2})
    assert 1 not in stream.ended
    stream.send(1, cancel=common_pb2.Cancel(reason="the test is done with it"))
    await stream.read_until({1})
    assert stream.finish_reason(1) == common_pb2.FINISH_REASON_ABORT
    assert len(stream.token_ids(1)) < LONG.max_tokens
    assert stream.finish_reason(2) == common_pb2.FINISH_REASON_LENGTH
    assert await all_idle([worker.stub])
    stream.half_close()
    assert await stream.call.code() == grpc.StatusCode.OK


async def test_bad_messages_fail_their_own_generation_and_no_other(
    worker: InProcessWorker,
) -> None:
    stream = ManyStream(worker.stub.GenerateMany)
    stream.send(1)  # neither a request nor a cancel
    stream.send(2, request=request("empty", []))
    stream.send(3, request=request("good", PROMPTS[2]))
    stream.send(4, request=request("twice", PROMPTS[0], LONG))
    stream.send(5, request=request("twice", PROMPTS[1]))  # its id is in use by 4
    await stream.read_until({1, 2, 3, 5})
    failures = {i: error_from_status(status) for i, status in stream.errors.items()}
    assert {i: e.status for i, e in failures.items()} == {
        1: "INVALID_ARGUMENT",
        2: "INVALID_ARGUMENT",
        5: "ALREADY_EXISTS",
    }
    assert "prompt_token_ids" in str(failures[2])
    assert stream.finish_reason(3) == common_pb2.FINISH_REASON_LENGTH
    assert 4 not in stream.ended  # the first "twice" runs on
    stream.send(4, cancel=common_pb2.Cancel())
    await stream.read_until({4})
    assert await all_idle([worker.stub])
    stream.half_close()


async def test_a_generation_past_its_deadline_finishes_with_what_it_has(
    worker: InProcessWorker,
) -> None:
    stream = ManyStream(worker.stub.GenerateMany)
    # The tiny model takes about a millisecond a token: 400 take past the deadline.
    stream.send(1, request=request("late", PROMPTS[0], LONG), timeout_ms=150)
    await stream.read_until({1})
    assert stream.finish_reason(1) == common_pb2.FINISH_REASON_DEADLINE
    assert len(stream.token_ids(1)) < LONG.max_tokens
    assert await all_idle([worker.stub])
    stream.half_close()


async def test_a_broken_stream_stops_every_generation_on_it(worker: InProcessWorker) -> None:
    stream = ManyStream(worker.stub.GenerateMany)
    for i, prompt in enumerate(PROMPTS):
        stream.send(i + 1, request=request(f"cut-{i}", prompt, LONG))
    await stream.call.read()  # the first tokens are out: all three are running

    async def running() -> bool:
        return (await worker.stats()).running == len(PROMPTS)

    assert await wait_until(running)
    stream.call.cancel()
    assert await all_idle([worker.stub])


async def test_generate_many_needs_a_colocated_worker(tiny_llama_dir: Path) -> None:
    prefill = await start_worker(tiny_llama_dir, "prefill")
    try:
        stream = ManyStream(prefill.stub.GenerateMany)
        stream.send(1, request=request("nowhere", PROMPTS[0]))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stream.read_until({1})
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "colocated" in (refused.value.details() or "")
    finally:
        await prefill.stop()
