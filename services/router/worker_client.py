"""The four calls the router makes to workers, behind one small interface.

The orchestrator keeps the rules (attempts, resume, retry, releases); a `WorkerClient` makes
the calls and reports failures as KvmeshError naming the RPC and the worker, so that the rules
never see a gRPC object and their tests fake these four methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Protocol

import grpc
from google.rpc import status_pb2
from opentelemetry import propagate

from kvmesh.client_streams import open_stream
from kvmesh.errors import DeadlineExceeded, KvmeshError, Unavailable
from kvmesh.rpc_status import error_from_rpc, error_from_status
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.router.peers import Peers

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 2.0


class WorkerClient(Protocol):
    """Calls to one worker each; `time_left` is the caller's, in seconds (None: no deadline)."""

    def colocated(
        self, address: str, request: common_pb2.InferenceRequest, time_left: float | None
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        """Generate on a colocated worker: its events until Finished (closing cancels it)."""
        ...

    async def prefill(
        self, address: str, request: worker_pb2.PrefillRequest, time_left: float | None
    ) -> worker_pb2.PrefillResponse:
        """Prefill: the first token, and a lease on the prompt's KV unless it finished."""
        ...

    def decode(
        self, address: str, start: worker_pb2.DecodeRequest, time_left: float | None
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        """Decode a lease's KV: the echo of the first token once imported, then the rest
        (closing cancels the call)."""
        ...

    async def release(self, address: str, lease_id: str) -> None:
        """Ends a lease no decode imported; a failure is logged (the lease's TTL covers it)."""
        ...


class GrpcWorkers:
    """WorkerClient over the router's traced channels; colocated generations share one
    Worker.GenerateMany stream per worker (GenerationStream)."""

    def __init__(self, peers: Peers) -> None:
        self._peers = peers
        self._streams: dict[str, GenerationStream] = {}

    async def colocated(
        self, address: str, request: common_pb2.InferenceRequest, time_left: float | None
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        stream = self._streams.get(address)
        if stream is None or not stream.takes_more:
            # Untraced: the stream outlives any one request; each generation carries its own.
            stub = self._peers.worker(address, traced=False)
            stream = self._streams[address] = GenerationStream(stub, address)
            stream.ended.add_done_callback(lambda _: self._forget(address, stream))
        async with contextlib.aclosing(stream.generate(request, time_left)) as events:
            async for event in events:
                yield event

    def _forget(self, address: str, stream: GenerationStream) -> None:
        """Drops an ended stream (a departed worker's would stay otherwise)."""
        if self._streams.get(address) is stream:
            del self._streams[address]

    async def prefill(
        self, address: str, request: worker_pb2.PrefillRequest, time_left: float | None
    ) -> worker_pb2.PrefillResponse:
        try:
            response: worker_pb2.PrefillResponse = await self._peers.worker(address).Prefill(
                request, timeout=time_left
            )
        except grpc.aio.AioRpcError as error:
            raise _worker_error(error, "Prefill", address) from None
        return response

    def decode(
        self, address: str, start: worker_pb2.DecodeRequest, time_left: float | None
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        stub = self._peers.worker(address)
        message = worker_pb2.DecodeMessage(start=start)
        return _events(
            lambda: open_stream(
                lambda requests: stub.Decode(requests, timeout=time_left), (message,)
            ),
            "Decode",
            address,
        )

    async def release(self, address: str, lease_id: str) -> None:
        try:
            await self._peers.worker(address).ReleaseKv(
                worker_pb2.ReleaseKvRequest(lease_id=lease_id), timeout=RELEASE_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as error:
            log.info("ReleaseKv %s on %s: %s", lease_id, address, error.code().name)


class GenerationStream:
    """One Worker.GenerateMany call: the colocated generations the router runs on one worker,
    each under a number of the stream's, their events coming back batched.

    It lasts while generations are open: once its last one ends it half-closes and takes no
    more, and the worker ends the call (so a retired worker's channel can close: peers.py);
    the next generation opens a new stream. A generation past its deadline fails with
    DeadlineExceeded, as its own call's would; one closed early is cancelled on the worker by
    a Cancel message; a stream that breaks fails every generation on it with its status."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, address: str) -> None:
        self.address = address
        self.takes_more = True
        """False once it has half-closed, or broke: generations go to a new stream."""
        self._outbox: asyncio.Queue[worker_pb2.GenerateManyMessage | None] = asyncio.Queue()
        self._inboxes: dict[int, asyncio.Queue[common_pb2.GenerateEvent | KvmeshError]] = {}
        self._numbers = itertools.count(1)
        self._call = open_stream(stub.GenerateMany, self._messages())
        self.ended = asyncio.create_task(self._read())
        """Done when the call has ended."""

    async def generate(
        self, request: common_pb2.InferenceRequest, time_left: float | None
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        """One generation's events until Finished (closing it early cancels it)."""
        stream_id = next(self._numbers)
        inbox = self._inboxes[stream_id] = asyncio.Queue()
        trace_context: dict[str, str] = {}
        propagate.inject(trace_context)
        self._outbox.put_nowait(
            worker_pb2.GenerateManyMessage(
                stream_id=stream_id,
                request=request,
                timeout_ms=0 if time_left is None else max(1, round(time_left * 1000)),
                trace_context=trace_context,
            )
        )
        deadline = None if time_left is None else time.monotonic() + time_left
        ended = False
        try:
            while True:
                item = await self._next(inbox, deadline)
                if isinstance(item, KvmeshError):
                    ended = True
                    raise _named(item, "Generate", self.address)
                ended = item.WhichOneof("event") == "finished"
                yield item
                if ended:
                    return
        finally:
            self._close(stream_id, cancel=not ended)

    async def _next(
        self,
        inbox: asyncio.Queue[common_pb2.GenerateEvent | KvmeshError],
        deadline: float | None,
    ) -> common_pb2.GenerateEvent | KvmeshError:
        if deadline is None:
            return await inbox.get()
        try:
            return await asyncio.wait_for(inbox.get(), max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            return DeadlineExceeded("Deadline Exceeded")

    def _close(self, stream_id: int, cancel: bool) -> None:
        del self._inboxes[stream_id]
        if not self.takes_more:
            return  # broke, or already half-closed: the worker has stopped it
        if cancel:
            reason = "the router closed the generation"
            cancel_message = worker_pb2.GenerateManyMessage(
                stream_id=stream_id, cancel=common_pb2.Cancel(reason=reason)
            )
            self._outbox.put_nowait(cancel_message)
        if not self._inboxes:
            self.takes_more = False
            self._outbox.put_nowait(None)

    async def _messages(self) -> AsyncIterator[worker_pb2.GenerateManyMessage]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def _read(self) -> None:
        """Hands each event to its generation; when the call ends, every generation still
        open gets the call's error (UNAVAILABLE when the worker ended it without one)."""
        failure: grpc.aio.AioRpcError | None = None
        try:
            async for message in self._call:
                for item in message.events:
                    if (inbox := self._inboxes.get(item.stream_id)) is not None:
                        inbox.put_nowait(_event_or_error(item))
        except grpc.aio.AioRpcError as error:
            failure = error
        finally:
            self.takes_more = False
            for inbox in self._inboxes.values():  # an error each: each gets its own prefix
                ended = Unavailable("the worker ended its GenerateMany stream")
                inbox.put_nowait(ended if failure is None else error_from_rpc(failure))


def _event_or_error(item: worker_pb2.GenerationEvent) -> common_pb2.GenerateEvent | KvmeshError:
    if item.WhichOneof("outcome") == "error":
        return error_from_status(status_pb2.Status.FromString(item.error))
    return item.event


async def _events(
    open_call: Callable[[], Any], rpc: str, address: str
) -> AsyncGenerator[common_pb2.GenerateEvent]:
    """A bidi call's events. The call opens when the first event is asked for, its one message
    given as the request iterator (through open_stream): grpc sends it and half-closes on its
    own task, which ends with the iterator. (Our own write/done_writing went through grpc.aio's
    interceptor proxy, a queue read by grpc's request task, which waits on it forever when the
    call ends by itself, a deadline, between the write and done_writing: "Task was destroyed
    but it is pending!" in the router's log under deadline storms.) The call is cancelled when
    this closes (the router stops a Decode by cancelling its call, never by a Cancel message;
    a colocated generation shares its call, and is stopped by a Cancel: GenerationStream)."""
    call = open_call()
    try:
        async for event in call:
            yield event
    except grpc.aio.AioRpcError as error:
        raise _worker_error(error, rpc, address) from None
    finally:
        call.cancel()


def _worker_error(error: grpc.aio.AioRpcError, rpc: str, address: str) -> KvmeshError:
    return _named(error_from_rpc(error), rpc, address)


def _named(error: KvmeshError, rpc: str, address: str) -> KvmeshError:
    """The error with the call and the worker it came from in front of its message."""
    error.message = f"{rpc} on {address}: {error.message}"
    return error
