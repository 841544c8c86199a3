"""GenerateMany from a servicer's side: the generations of one call run side by side.

Each GenerateManyMessage (or GenerateManyClientMessage, on the gateway) opens or cancels one
generation; kvmesh/generation_mux.py runs them, and their events go out batched, one
GenerateManyEvents message for everything ready since the last send. kvmesh/generate_many.py
is the caller's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any

import grpc

from kvmesh.errors import InvalidArgument, KvmeshError, Unavailable
from kvmesh.generate_many import Message
from kvmesh.generation_mux import GenerationMux
from kvmesh.grpc_server import SERVER_DRAINING
from kvmesh.rpc_status import to_status_proto
from kvmesh.server_tracing import server_span
from kvmesh.v1 import common_pb2

log = logging.getLogger(__name__)

OpenGeneration = Callable[
    [Message, asyncio.Event, float | None], AsyncGenerator[common_pb2.GenerateEvent]
]
"""Opens one generation of the stream: its request message, the event its Cancel sets, and
the seconds it may take (None: no deadline)."""


async def serve_many(
    first: Message,
    messages: AsyncIterator[Message],
    context: grpc.aio.ServicerContext,
    method: str,
    generation: OpenGeneration[Message],
    spawn: Callable[[Coroutine[Any, Any, None]], object],
) -> AsyncIterator[common_pb2.GenerateManyEvents]:
    """A GenerateMany call's answer: opens and cancels its generations as their messages
    arrive, sends what they produced as it is ready, and ends once the caller has half-closed
    and every generation has ended. Once its server drains (SERVER_DRAINING) every message
    says so, the first at once: the caller, who keeps an idle call open a while for its next
    request (kvmesh/generate_many.py), then half-closes it instead of holding the drain, and
    a request it sent before it knew is refused with UNAVAILABLE, as a new call would be.
    Each generation runs under a server span named `method`, as its own call's would be.
    Leaving it early cancels every generation still running, and so does the end of the RPC
    (gRPC may drop a handler whose caller went away without resuming it): `spawn` runs that
    in the background."""
    mux: GenerationMux[common_pb2.GenerateEvent] = GenerationMux()
    context.add_done_callback(lambda _: spawn(mux.close()))
    draining = SERVER_DRAINING.get(asyncio.Event())
    opened = functools.partial(_spanned, method, generation)
    reader = asyncio.create_task(_read(first, messages, mux, opened, draining))
    notice = asyncio.create_task(_flush_once(draining, mux))
    try:
        async for batch in mux.batches():
            yield common_pb2.GenerateManyEvents(
                events=[_generation_event(stream_id, item) for stream_id, item in batch],
                draining=draining.is_set(),
            )
        await reader  # its failure (a message that could not be decoded) ends the call
    finally:
        reader.cancel()
        notice.cancel()
        await mux.close()


async def _flush_once(draining: asyncio.Event, mux: GenerationMux[Any]) -> None:
    """Sends the drain's notice as soon as it starts, with whatever is ready."""
    await draining.wait()
    mux.flush()


Opened = Callable[[Message, asyncio.Event], AsyncIterator[common_pb2.GenerateEvent]]
"""A generation opened under its span: its request message and the event its Cancel sets."""


async def _read(
    first: Message,
    messages: AsyncIterator[Message],
    mux: GenerationMux[common_pb2.GenerateEvent],
    generation: Opened[Message],
    draining: asyncio.Event,
) -> None:
    try:
        _dispatch(first, mux, generation, draining)
        async for message in messages:
            _dispatch(message, mux, generation, draining)
    finally:
        mux.no_more()


def _dispatch(
    message: Message,
    mux: GenerationMux[common_pb2.GenerateEvent],
    generation: Opened[Message],
    draining: asyncio.Event,
) -> None:
    kind = message.WhichOneof("message")
    if kind == "request" and draining.is_set():
        mux.fail(message.stream_id, Unavailable("the server is draining: retry on another"))
    elif kind == "request":
        mux.open(message.stream_id, functools.partial(generation, message))
    elif kind == "cancel":
        reason = message.cancel.reason or "no reason given"
        log.info("generation %d cancelled by the caller: %s", message.stream_id, reason)
        mux.cancel(message.stream_id)
    else:
        mux.fail(message.stream_id, InvalidArgument("message", "needs a request or a cancel"))


async def _spanned(
    method: str, generation: OpenGeneration[Message], message: Message, cancelled: asyncio.Event
) -> AsyncIterator[common_pb2.GenerateEvent]:
    """A generation under a span of its own whose parent is the caller's (the message's trace
    context), given the message's timeout in seconds."""
    timeout_s = message.timeout_ms / 1000 if message.timeout_ms else None
    with server_span(method, dict(message.trace_context)):
        async with contextlib.aclosing(generation(message, cancelled, timeout_s)) as events:
            async for event in events:
                yield event


def _generation_event(
    stream_id: int, item: common_pb2.GenerateEvent | KvmeshError
) -> common_pb2.GenerationEvent:
    if isinstance(item, KvmeshError):
        error = to_status_proto(item).SerializeToString()
        return common_pb2.GenerationEvent(stream_id=stream_id, error=error)
    return common_pb2.GenerationEvent(stream_id=stream_id, event=item)
