"""Client-streaming gRPC calls whose request side ends with the call.

grpc.aio writes a call's request iterator from a task of its own, and that task waits for the
call's headers to be sent before its first write. When the call ends before they are sent (a
deadline or a cut reached before the connection took the call) and the task reading the call
is cancelled in that moment, grpc cancels the header send, never says the headers are out, and
leaves its writer waiting: the call is done, so cancelling it no longer reaches the writer
(grpc/grpc#37355 proposed the fix upstream, unmerged). The task is then collected while pending
("Task was destroyed but it is pending!", an ERROR line) under deadline storms. `open_stream`
waits for the headers itself, beside the call's end, so grpc's writer never waits for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

Call = TypeVar("Call")
Message = TypeVar("Message")


def open_stream(
    start: Callable[[AsyncIterator[Message]], Call],
    messages: AsyncIterable[Message] | Iterable[Message],
) -> Call:
    """The call `start(requests)` makes, its requests being `messages`, handed to grpc only
    once the call's headers are sent (none when the call ended first)."""
    started: list[Any] = []

    async def requests() -> AsyncIterator[Message]:
        if not await headers_sent(started[0]):
            return
        if isinstance(messages, AsyncIterable):
            async for message in messages:
                yield message
        else:
            for message in messages:
                yield message

    call = start(requests())
    started.append(call)
    return call


async def headers_sent(call: Any) -> bool:
    """Whether a client-streaming call sent its headers and is still running: waits for
    either that or the call's end (grpc's own wait for the headers alone can last forever)."""
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def end(_: object) -> None:
        if not ended.done():
            ended.set_result(None)

    call.add_done_callback(end)
    connected = asyncio.ensure_future(call.wait_for_connection())
    try:
        await asyncio.wait((connected, ended), return_when=asyncio.FIRST_COMPLETED)
    finally:
        connected.cancel()
    return connected.done() and not connected.cancelled() and connected.exception() is None
