"""A generation's calls end when the HTTP client goes away, at once and at the gateway too."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from services.openai_http import schemas, translation
from services.openai_http.generation import ClientGone, Generation
from services.openai_http.translation import DoorHeaders

pytestmark = pytest.mark.unit


class Stalling:
    """A gateway that takes every Generate and answers nothing; notes the calls cancelled."""

    def __init__(self) -> None:
        self.calls = 0
        self.called = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def generate(self, requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.calls += 1
        self.called.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    def handler(self) -> grpc.GenericRpcHandler:
        generate = grpc.stream_stream_rpc_method_handler(self.generate)
        return grpc.method_handlers_generic_handler("kvmesh.v1.Gateway", {"Generate": generate})


async def test_a_client_that_leaves_ends_the_events_and_cancels_the_calls() -> None:
    server = grpc.aio.server()
    gateway = Stalling()
    server.add_generic_rpc_handlers((gateway.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        body = schemas.CompletionRequest.model_validate({"model": "m", "prompt": "hi", "n": 2})
        plan = translation.completion_plan(body, DoorHeaders("k"), max_prompts=1)
        gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        generation = Generation(plan, channel)
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
    finally:
        await channel.close()
        await server.stop(None)


async def test_closing_the_generation_stops_watching_the_client() -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:1")
    body = schemas.CompletionRequest.model_validate({"model": "m", "prompt": "hi"})
    plan = translation.completion_plan(body, DoorHeaders("k"), max_prompts=1)
    watched = asyncio.Event()

    async def client_gone() -> None:
        watched.set()
        await asyncio.Event().wait()

    generation = Generation(plan, channel)
    generation.start(client_gone=client_gone())
    await watched.wait()
    await generation.aclose()
    assert [t for t in asyncio.all_tasks() if "client_gone" in repr(t)] == []
    await channel.close()
