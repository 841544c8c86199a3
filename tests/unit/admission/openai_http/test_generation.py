"""A generation's requests end when the HTTP client goes away or their deadline passes, at
once and at the gateway too; a bug is an error, never a request that hangs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvmesh.errors import DeadlineExceeded, Internal
from kvmesh.v1 import common_pb2, gateway_pb2
from services.admission.openai_http import schemas, translation
from services.admission.openai_http.generation import ClientGone, Generation
from services.admission.openai_http.translation import DoorHeaders

pytestmark = pytest.mark.unit


class Stalling:
    """A gateway that takes every request and answers nothing; notes the requests cancelled."""

    def __init__(self) -> None:
        self.calls = 0
        self.called = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def generate(
        self, request: gateway_pb2.GenerateRequest, time_left_s: float | None
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        self.calls += 1
        self.called.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        yield common_pb2.GenerateEvent()


async def staying() -> None:
    """A client that never leaves."""
    await asyncio.Event().wait()


def completion_plan(deadline_s: float | None = None, n: int = 1) -> translation.Plan:
    body = schemas.CompletionRequest.model_validate({"model": "m", "prompt": "hi", "n": n})
    return translation.completion_plan(body, DoorHeaders("k", deadline_s=deadline_s), 1)


async def test_a_client_that_leaves_ends_the_events_and_cancels_the_requests() -> None:
    gateway = Stalling()
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    generation = Generation(completion_plan(n=2), gateway.generate)
    generation.start(client_gone=gone)
    events = generation.events()
    await asyncio.wait_for(gateway.called.wait(), 5.0)
    gone.set_result(None)
    event = await asyncio.wait_for(anext(events), 1.0)
    assert isinstance(event.error, ClientGone)
    await asyncio.wait_for(gateway.cancelled.wait(), 1.0)
    await generation.aclose()
    # Only the prompt's first sample started: the second waits for its first token.
    assert gateway.calls == 1


async def test_a_request_past_its_deadline_ends_with_deadline_exceeded_and_is_cancelled() -> None:
    gateway = Stalling()
    generation = Generation(completion_plan(deadline_s=0.05), gateway.generate)
    generation.start(client_gone=staying())
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(generation.results(), 5.0)
    assert gateway.cancelled.is_set()
    await generation.aclose()


async def test_a_deadline_finish_with_no_token_is_deadline_exceeded() -> None:
    """The gateway ends a request short of its deadline (to send the partial answer in time):
    with no token to send, the door's answer is the deadline's error, not an empty choice."""

    async def out_of_time(
        request: gateway_pb2.GenerateRequest, time_left_s: float | None
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        yield common_pb2.GenerateEvent(
            finished=common_pb2.Finished(finish_reason=common_pb2.FINISH_REASON_DEADLINE)
        )

    generation = Generation(completion_plan(deadline_s=5.0), out_of_time)
    generation.start(client_gone=staying())
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(generation.results(), 5.0)
    await generation.aclose()


async def test_a_bug_in_the_gateway_ends_the_request_with_an_internal_error() -> None:
    async def broken(
        request: gateway_pb2.GenerateRequest, time_left_s: float | None
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        raise ZeroDivisionError("a bug")
        yield common_pb2.GenerateEvent()

    generation = Generation(completion_plan(), broken)
    generation.start(client_gone=staying())
    with pytest.raises(Internal, match="ZeroDivisionError"):
        await asyncio.wait_for(generation.results(), 5.0)
    await generation.aclose()


async def test_closing_the_generation_stops_watching_the_client() -> None:
    watched = asyncio.Event()

    async def client_gone() -> None:
        watched.set()
        await asyncio.Event().wait()

    generation = Generation(completion_plan(), Stalling().generate)
    generation.start(client_gone=client_gone())
    await watched.wait()
    await generation.aclose()
    assert [t for t in asyncio.all_tasks() if "client_gone" in repr(t)] == []
