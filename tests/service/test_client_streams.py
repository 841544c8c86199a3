"""kvmesh.client_streams.open_stream on real grpc.aio channels (kvmesh's, with their client
interceptors): messages flow as they would without it, and a call that ends before its headers
are sent leaves none of grpc's request-writer tasks waiting (the gateway's Router.Generate and
the router's worker calls open their streams through it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from kvmesh.channels import insecure_channel
from kvmesh.client_streams import open_stream

METHOD = "/kvmesh.test.Echo/Echo"
CALLS = 10


def _identity(message: bytes) -> bytes:
    return message


async def _echo(
    messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext
) -> AsyncIterator[bytes]:
    async for message in messages:
        yield message


@pytest.fixture
async def echo_address() -> AsyncIterator[str]:
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(_echo, _identity, _identity)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("kvmesh.test.Echo", {"Echo": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


@pytest.fixture
async def silent_address() -> AsyncIterator[str]:
    """A TCP peer that accepts and never answers: grpc never gets to send a call's headers."""

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()


async def _messages(count: int) -> AsyncIterator[bytes]:
    for index in range(count):
        yield b"m%d" % index


async def test_messages_flow_in_order_from_async_and_plain_iterables(echo_address: str) -> None:
    async with insecure_channel(echo_address) as channel:
        echo = channel.stream_stream(METHOD, _identity, _identity)
        from_async = open_stream(lambda requests: echo(requests, timeout=10), _messages(50))
        assert [message async for message in from_async] == [b"m%d" % i for i in range(50)]
        from_plain = open_stream(lambda requests: echo(requests, timeout=10), (b"one", b"two"))
        assert [message async for message in from_plain] == [b"one", b"two"]
        assert await from_plain.code() == grpc.StatusCode.OK


def _request_writers() -> list[asyncio.Task[object]]:
    # grpc.aio's task that writes a call's request iterator (a private name, looked up here
    # only to see whether any is left waiting).
    return [
        task
        for task in asyncio.all_tasks()
        if "_consume_request_iterator" in repr(task.get_coro()) and not task.done()
    ]


async def _end_before_headers(address: str, through_open_stream: bool) -> list[object]:
    """CALLS calls that reach their deadline before the peer takes them, each one's reader
    cancelled as the call ends (a gateway handler cancelled by the same deadline). Returns the
    calls, kept alive so that a waiting writer is seen rather than collected."""
    calls: list[object] = []
    async with insecure_channel(address) as channel:
        echo = channel.stream_stream(METHOD, _identity, _identity)
        for _ in range(CALLS):
            if through_open_stream:
                call = open_stream(lambda requests: echo(requests, timeout=0.1), _messages(1))
            else:
                call = echo(_messages(1), timeout=0.1)
            reader = asyncio.ensure_future(_drain(call))
            call.add_done_callback(lambda _, reader=reader: reader.cancel())
            with pytest.raises((asyncio.CancelledError, grpc.aio.AioRpcError)):
                await reader
            assert call.done()
            calls.append(call)
        await asyncio.sleep(0.2)
    return calls


async def _drain(call: AsyncIterator[bytes]) -> None:
    async for _ in call:
        pass


async def test_a_call_ended_before_its_headers_leaves_no_writer_waiting(
    silent_address: str,
) -> None:
    calls = await _end_before_headers(silent_address, through_open_stream=True)
    assert len(calls) == CALLS
    assert _request_writers() == []


async def test_without_open_stream_grpc_leaves_every_such_writer_waiting(
    silent_address: str,
) -> None:
    """Why open_stream exists: on grpc's own iterator the same calls strand their writers. If
    a grpc release stops doing so, this fails, and open_stream can go."""
    assert _request_writers() == []
    calls = await _end_before_headers(silent_address, through_open_stream=False)
    stranded = _request_writers()
    for writer in stranded:
        writer.cancel()  # not left to be collected pending, which would log an ERROR
    await asyncio.gather(*stranded, return_exceptions=True)
    assert len(stranded) == len(calls) == CALLS
