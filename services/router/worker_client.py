"""The four calls the router makes to workers, behind one small interface.

The orchestrator keeps the rules (attempts, resume, retry, releases); a `WorkerClient` makes
the calls and reports failures as KvmeshError naming the RPC and the worker, so that the rules
never see a gRPC object and their tests fake these four methods.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

import grpc

from kvmesh.client_streams import open_stream
from kvmesh.errors import KvmeshError
from kvmesh.generate_many import GenerateManyCall
from kvmesh.rpc_status import error_from_rpc
from kvmesh.v1 import common_pb2, worker_pb2
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
    Worker.GenerateMany call per worker (kvmesh/generate_many.py)."""

    def __init__(self, peers: Peers) -> None:
        self._peers = peers
        self._calls: dict[str, GenerateManyCall[common_pb2.GenerateManyMessage]] = {}
        peers.on_retire.append(self._finish_call)

    async def colocated(
        self, address: str, request: common_pb2.InferenceRequest, time_left: float | None
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        call = self._calls.get(address)
        if call is None or not call.takes_more:
            # Untraced: the call outlives any one request; each generation carries its own.
            stub = self._peers.worker(address, traced=False)
            call = GenerateManyCall(stub.GenerateMany, common_pb2.GenerateManyMessage, "the worker")
            self._calls[address] = call
            call.ended.add_done_callback(lambda _: self._forget(address, call))
        opening = common_pb2.GenerateManyMessage(request=request)
        generation = call.generate(opening, time_left)
        try:
            async for event in generation.events():
                yield event
        except KvmeshError as error:
            raise _named(error, "Generate", address) from None
        finally:
            generation.close("the router closed the generation")

    def _finish_call(self, address: str) -> None:
        """A departed worker's call takes no more and ends with its last generation."""
        if (call := self._calls.pop(address, None)) is not None:
            call.finish()

    def _forget(self, address: str, call: GenerateManyCall[common_pb2.GenerateManyMessage]) -> None:
        """Drops an ended call (a departed worker's would stay otherwise)."""
        if self._calls.get(address) is call:
            del self._calls[address]

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
    a colocated generation shares its call, and is stopped by a Cancel: GrpcWorkers.colocated)."""
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
