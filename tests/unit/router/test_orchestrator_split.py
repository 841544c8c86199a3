"""The split path's calls to the workers, against a stand-in WorkerClient: when the first token goes
out and the Decode call opens, what it is sent, and what is cancelled, released or resumed when
something fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import TypeAlias

import pytest

from kvmesh.errors import KvmeshError, Unavailable
from kvmesh.v1 import common_pb2, worker_pb2
from services.router.orchestrator import Orchestrator
from tests.unit.router.factories import healthy, registry, tier

PREFILL, DECODE = "prefill:1", "decode:1"
LEASE = common_pb2.KvLease(lease_id="lease-1", worker_address=PREFILL, num_tokens=3)
LEASE_2 = common_pb2.KvLease(lease_id="lease-2", worker_address=PREFILL, num_tokens=3)
FIRST = common_pb2.TokenChunk(token_ids=[7])
ECHO = common_pb2.GenerateEvent(chunk=FIRST)


def prefilled() -> worker_pb2.PrefillResponse:
    """A Prefill's answer: the first token (shown and sampled) and the lease."""
    return worker_pb2.PrefillResponse(first_token=FIRST, sampled=FIRST, lease=LEASE)


"""The decode worker's first chunk: the first token again, once the KV is imported."""
LENGTH = common_pb2.GenerateEvent(
    finished=common_pb2.Finished(finish_reason=common_pb2.FINISH_REASON_LENGTH)
)


DecodeStep: TypeAlias = common_pb2.GenerateEvent | KvmeshError | asyncio.Event
"""What a stand-in Decode does next: stream an event, fail, or wait for the event."""


@dataclass
class FakeDecodeCall:
    """One Decode: what it was sent, and whether the router let go of it (it always must)."""

    written: list[worker_pb2.DecodeMessage]
    cancelled: bool = False


@dataclass
class FakeWorkers:
    """A WorkerClient over stand-in workers. The first Prefill answers when the test resolves
    `prefill`, later ones with `retry_prefill`; the first Decode plays `decode_steps`, later
    ones `retry_decode_steps` (both default to the first call's)."""

    prefill_answer: asyncio.Future[worker_pb2.PrefillResponse]
    decode_steps: list[DecodeStep]
    retry_prefill: worker_pb2.PrefillResponse | None = None
    retry_decode_steps: list[DecodeStep] | None = None
    prefill_requests: list[worker_pb2.PrefillRequest] = field(default_factory=list)
    decode_calls: list[FakeDecodeCall] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    def colocated(
        self, address: str, request: common_pb2.InferenceRequest, time_left: float | None
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        raise AssertionError("these tests place every request split")

    async def prefill(
        self, address: str, request: worker_pb2.PrefillRequest, time_left: float | None
    ) -> worker_pb2.PrefillResponse:
        self.prefill_requests.append(request)
        if len(self.prefill_requests) > 1 and self.retry_prefill is not None:
            return self.retry_prefill
        return await asyncio.shield(self.prefill_answer)

    async def decode(
        self, address: str, start: worker_pb2.DecodeRequest, time_left: float | None
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        steps = self.decode_steps
        if self.decode_calls and self.retry_decode_steps is not None:
            steps = self.retry_decode_steps
        call = FakeDecodeCall([worker_pb2.DecodeMessage(start=start)])
        self.decode_calls.append(call)
        try:
            for step in steps:
                if isinstance(step, asyncio.Event):
                    await step.wait()
                elif isinstance(step, KvmeshError):
                    raise step
                else:
                    yield step
        finally:
            call.cancelled = True

    async def release(self, address: str, lease_id: str) -> None:
        self.released.append(lease_id)


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


def rpc_error(details: str) -> KvmeshError:
    """A worker's failure as the WorkerClient reports it."""
    return Unavailable(details)


def chunk(*token_ids: int) -> common_pb2.GenerateEvent:
    return common_pb2.GenerateEvent(chunk=common_pb2.TokenChunk(token_ids=token_ids))


async def first_two(
    events: AsyncIterator[common_pb2.GenerateEvent],
) -> list[common_pb2.GenerateEvent]:
    """Started and the first chunk, which must come without the decode worker's help."""
    return [await asyncio.wait_for(anext(events), 5) for _ in range(2)]


def kinds(events: list[common_pb2.GenerateEvent]) -> list[str | None]:
    return [event.WhichOneof("event") for event in events]


def tokens(events: list[common_pb2.GenerateEvent]) -> list[int]:
    return [t for event in events for t in event.chunk.token_ids]


async def test_the_decode_call_opens_once_the_prefill_answered() -> None:
    workers = FakeWorkers(asyncio.get_running_loop().create_future(), [ECHO, LENGTH])
    running = asyncio.ensure_future(run(orchestrator(workers)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not workers.prefill_answer.done()
    # Not opened while the prompt runs: setting it up would slow the Prefill call's start.
    assert workers.decode_calls == []

    workers.prefill_answer.set_result(prefilled())
    events = await running
    assert kinds(events) == ["started", "chunk", "finished"]
    (call,) = workers.decode_calls
    (start,) = call.written
    assert start.start.lease == LEASE and start.start.first_token == FIRST
    assert start.start.sampled == FIRST
    assert start.start.request.request_id == "r"
    assert workers.released == []  # the decode worker releases the lease it pulled


async def test_a_failed_prefill_opens_no_decode_call() -> None:
    workers = FakeWorkers(asyncio.get_running_loop().create_future(), [])
    workers.prefill_answer.set_exception(rpc_error("gone"))
    with pytest.raises(Unavailable, match="gone"):
        await run(orchestrator(workers))
    assert len(workers.prefill_requests) == 2  # the first try and the retry
    assert workers.decode_calls == [] and workers.released == []


async def test_a_request_ended_by_its_first_token_opens_no_decode_call() -> None:
    finished = common_pb2.Finished(finish_reason=common_pb2.FINISH_REASON_STOP)
    workers = FakeWorkers(asyncio.get_running_loop().create_future(), [])
    workers.prefill_answer.set_result(
        worker_pb2.PrefillResponse(first_token=FIRST, sampled=FIRST, finished=finished)
    )
    events = await run(orchestrator(workers))
    assert kinds(events) == ["started", "chunk", "finished"]
    assert workers.decode_calls == []


async def test_a_decode_that_never_starts_releases_the_lease() -> None:
    workers = FakeWorkers(asyncio.get_running_loop().create_future(), [])  # ends at once
    workers.prefill_answer.set_result(prefilled())
    with pytest.raises(Unavailable):
        await run(orchestrator(workers))
    await asyncio.sleep(0.01)  # releases run in the background
    assert workers.released == ["lease-1", "lease-1"]
    assert all(call.cancelled for call in workers.decode_calls)


async def test_the_first_token_reaches_the_caller_before_the_kv_hand_off() -> None:
    importing = asyncio.Event()  # the decode worker is busy pulling the KV until this is set
    workers = FakeWorkers(
        asyncio.get_running_loop().create_future(), [importing, ECHO, chunk(8), LENGTH]
    )
    workers.prefill_answer.set_result(prefilled())
    events = orchestrator(workers).run(inference_request(), None, asyncio.Event(), set())
    ahead = await first_two(events)
    assert kinds(ahead) == ["started", "chunk"] and ahead[1].chunk == FIRST
    (call,) = workers.decode_calls
    assert [m.start.first_token for m in call.written] == [FIRST]

    importing.set()
    rest = [event async for event in events]
    assert kinds(rest) == ["chunk", "finished"]
    assert tokens(rest) == [8]  # the decode worker's echo of the first token is not forwarded
    await asyncio.sleep(0.01)
    assert workers.released == []  # the decode worker imported, so it releases the lease


async def test_a_hand_off_failing_after_the_first_token_resumes_from_that_token() -> None:
    workers = FakeWorkers(
        asyncio.get_running_loop().create_future(),
        [rpc_error("pulling KV failed")],
        # The prompt's second run samples another token: the caller keeps the first one.
        retry_prefill=worker_pb2.PrefillResponse(
            first_token=common_pb2.TokenChunk(token_ids=[9]),
            sampled=common_pb2.TokenChunk(token_ids=[9]),
            lease=LEASE_2,
        ),
        retry_decode_steps=[ECHO, chunk(8), LENGTH],
    )
    workers.prefill_answer.set_result(prefilled())
    events = await run(orchestrator(workers))
    assert kinds(events) == ["started", "chunk", "chunk", "finished"]
    assert tokens(events) == [7, 8]
    assert events[0].started.placement.attempts == 1  # sent before the hand-off failed
    assert [r.request.request_id for r in workers.prefill_requests] == ["r", "r~2"]
    _, resumed = workers.decode_calls
    (start,) = resumed.written
    assert start.start.first_token == FIRST and start.start.lease == LEASE_2
    assert start.start.sampled == FIRST  # decoding continues after the token the caller has
    await asyncio.sleep(0.01)
    assert workers.released == ["lease-1"]  # the failed hand-off's; lease-2 was imported


async def test_a_failure_after_the_hand_off_is_not_resumed() -> None:
    workers = FakeWorkers(
        asyncio.get_running_loop().create_future(), [ECHO, chunk(8), rpc_error("decode died")]
    )
    workers.prefill_answer.set_result(prefilled())
    with pytest.raises(Unavailable, match="not re-run") as raised:
        await run(orchestrator(workers))
    assert "completion_tokens=2" in raised.value.message
    assert (len(workers.prefill_requests), len(workers.decode_calls)) == (1, 1)
    # The lease is granted for the decode worker the router chose: only it may pull it.
    assert workers.prefill_requests[0].puller == DECODE
    await asyncio.sleep(0.01)
    assert workers.released == []


async def test_a_resumed_prompt_ending_at_its_own_first_token_cannot_continue() -> None:
    stop = common_pb2.Finished(finish_reason=common_pb2.FINISH_REASON_STOP)
    workers = FakeWorkers(
        asyncio.get_running_loop().create_future(),
        [rpc_error("pulling KV failed")],
        retry_prefill=worker_pb2.PrefillResponse(
            first_token=common_pb2.TokenChunk(token_ids=[2]),
            sampled=common_pb2.TokenChunk(token_ids=[2]),
            finished=stop,
        ),
    )
    workers.prefill_answer.set_result(prefilled())
    with pytest.raises(Unavailable, match="second run ended at its own first token"):
        await run(orchestrator(workers))
    assert len(workers.prefill_requests) == 2
    (call,) = workers.decode_calls  # none for the second run
    assert call.cancelled


DEADLINE_BEFORE_THE_PROMPT = worker_pb2.PrefillResponse(
    finished=common_pb2.Finished(
        finish_reason=common_pb2.FINISH_REASON_DEADLINE,
        usage=common_pb2.Usage(prompt_tokens=3),
    )
)
"""A Prefill whose deadline passed before its prompt ran: no token, no sampled token, no lease."""


async def test_a_prefill_ended_by_its_deadline_before_the_prompt_ran_is_a_deadline() -> None:
    workers = FakeWorkers(asyncio.get_running_loop().create_future(), [])
    workers.prefill_answer.set_result(DEADLINE_BEFORE_THE_PROMPT)
    events = await run(orchestrator(workers))
    assert kinds(events) == ["started", "finished"]
    assert events[-1].finished.finish_reason == common_pb2.FINISH_REASON_DEADLINE
    assert workers.decode_calls == []


async def test_a_resumed_prompt_ended_by_the_deadline_is_a_deadline_with_the_first_token() -> None:
    workers = FakeWorkers(
        asyncio.get_running_loop().create_future(),
        [rpc_error("pulling KV failed")],
        retry_prefill=DEADLINE_BEFORE_THE_PROMPT,
    )
    workers.prefill_answer.set_result(prefilled())
    events = await run(orchestrator(workers))
    assert kinds(events) == ["started", "chunk", "finished"]
    finished = events[-1].finished
    assert finished.finish_reason == common_pb2.FINISH_REASON_DEADLINE
    assert finished.usage.completion_tokens == 1  # the first token, which the caller has


async def test_a_cancel_during_the_hand_off_aborts_with_the_first_token_counted() -> None:
    workers = FakeWorkers(asyncio.get_running_loop().create_future(), [asyncio.Event()])
    workers.prefill_answer.set_result(prefilled())
    cancelled = asyncio.Event()
    events = orchestrator(workers).run(inference_request(), None, cancelled, set())
    ahead = await first_two(events)
    assert kinds(ahead) == ["started", "chunk"]
    cancelled.set()
    (last,) = [event async for event in events]
    assert last.finished.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert last.finished.usage.completion_tokens == 1
    await asyncio.sleep(0.01)
    (call,) = workers.decode_calls
    assert call.cancelled and workers.released == ["lease-1"]


def ticking(seconds: float) -> asyncio.Event:
    """A Decode step that waits `seconds` (a worker taking its time for the next token)."""
    event = asyncio.Event()
    asyncio.get_running_loop().call_later(seconds, event.set)
    return event


def stall_bounded(workers: FakeWorkers, step_s: float) -> Orchestrator:
    """An orchestrator that measured DECODE's step at `step_s` and calls a stream quiet for
    10 such steps (at least 0.1 s) stalled."""
    built = orchestrator(workers)
    built.stall_steps, built.stall_floor_s = 10, 0.1
    built.rates.observe_gap(DECODE, 1, step_s)
    return built


async def test_a_decode_worker_that_stops_sending_is_failed_with_the_usage_so_far() -> None:
    """Its health checks still pass (it never leaves the rotation), yet the stream fails
    within 10 of its 20 ms steps, after the first token: UNAVAILABLE with the usage."""
    workers = FakeWorkers(
        asyncio.get_running_loop().create_future(),
        [ECHO, chunk(8), chunk(9), asyncio.Event()],  # then nothing, ever
    )
    workers.prefill_answer.set_result(worker_pb2.PrefillResponse(first_token=FIRST, lease=LEASE))
    with pytest.raises(Unavailable) as raised:
        await asyncio.wait_for(run(stall_bounded(workers, 0.02)), 5)
    message = str(raised.value)
    assert f"{DECODE} sent nothing for" in message and "stalled" in message
    assert "completion_tokens=3" in message
    (call,) = workers.decode_calls
    assert call.cancelled


async def test_a_slow_decode_that_keeps_sending_is_not_cut() -> None:
    workers = FakeWorkers(
        asyncio.get_running_loop().create_future(),
        [ECHO, ticking(0.05), chunk(8), ticking(0.05), chunk(9), LENGTH],
    )
    workers.prefill_answer.set_result(worker_pb2.PrefillResponse(first_token=FIRST, lease=LEASE))
    events = await run(stall_bounded(workers, 0.02))  # 50 ms gaps, within 10 steps (0.2 s)
    assert tokens(events) == [7, 8, 9]
    assert events[-1].finished.finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_the_kv_hand_off_is_not_held_to_the_step_bound() -> None:
    """The gap from the first token to the first decoded one holds the KV pull: longer than
    10 steps here, and still not a stall."""
    workers = FakeWorkers(
        asyncio.get_running_loop().create_future(), [ticking(0.4), ECHO, chunk(8), LENGTH]
    )
    workers.prefill_answer.set_result(worker_pb2.PrefillResponse(first_token=FIRST, lease=LEASE))
    events = await run(stall_bounded(workers, 0.02))
    assert tokens(events) == [7, 8]


async def test_a_step_as_long_as_a_full_prefill_chunk_is_not_a_stall() -> None:
    """A worker that also prefills (colocated) is quiet on its decoding streams for a whole
    step of stall_step_tokens prompt tokens: 0.3 s here against a step bound of 0.2 s (2.3 s
    for 1,024 tokens on a 2-core AMD EPYC Zen 2 against the 2 s floor, where bench.peers lost
    an answer to it), within twice the measured prefill of those tokens (0.4 s)."""
    workers = FakeWorkers(
        asyncio.get_running_loop().create_future(),
        [ECHO, chunk(8), ticking(0.3), chunk(9), LENGTH],
    )
    workers.prefill_answer.set_result(worker_pb2.PrefillResponse(first_token=FIRST, lease=LEASE))
    built = stall_bounded(workers, 0.02)
    built.stall_step_tokens = 100
    built.rates.observe_prefill(DECODE, 100, 0.2)
    events = await run(built)
    assert tokens(events) == [7, 8, 9]
