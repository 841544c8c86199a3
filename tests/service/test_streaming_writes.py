"""A streaming servicer's response that gRPC's core fails to send (kvmesh.grpc_server writes a
generator servicer's responses itself): the call ends with core's status and one DEBUG line,
never an ERROR, and the server goes on serving. Real grpc.aio server and client on loopback."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from kvmesh.channels import MAX_MESSAGE_BYTES
from kvmesh.config import load_config
from kvmesh.grpc_server import GrpcServer, ServiceBinding
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker.config import WorkerConfig

# Over the server's send limit: core fails the batch that would write it.
OVERSIZED = common_pb2.KvChunk(data=b"x" * (MAX_MESSAGE_BYTES + 1))


class Chunks(worker_pb2_grpc.WorkerServicer):
    """PullKv answers block_indices[0] small chunks, then, where block_indices[1] is not 0,
    one over the send limit."""

    async def PullKv(
        self, request: worker_pb2.PullKvRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvChunk]:
        for index in range(request.block_indices[0]):
            yield common_pb2.KvChunk(block_index=index)
        if request.block_indices[1]:
            yield OVERSIZED


@pytest.fixture
async def stub() -> AsyncIterator[worker_pb2_grpc.WorkerStub]:
    config = load_config(WorkerConfig, ["--port", "0", "--metrics-port", "-1"])
    servicer = Chunks()  # type: ignore[abstract]  # serves PullKv only
    binding = ServiceBinding(
        "kvmesh.v1.Worker", servicer, worker_pb2_grpc.add_WorkerServicer_to_server
    )
    server = GrpcServer(config, "chunks", [binding])
    await server.start()
    options = [("grpc.max_receive_message_length", 4 * MAX_MESSAGE_BYTES)]
    async with grpc.aio.insecure_channel(server.address, options=options) as channel:
        yield worker_pb2_grpc.WorkerStub(channel)
    await server.stop()


async def pull(stub: worker_pb2_grpc.WorkerStub, small: int, oversized: bool) -> list[int]:
    request = worker_pb2.PullKvRequest(block_indices=[small, int(oversized)])
    return [chunk.block_index async for chunk in stub.PullKv(request, timeout=10)]


@pytest.mark.parametrize("small_before", [0, 2], ids=["first-write", "after-two-writes"])
async def test_a_response_core_cannot_send_ends_the_call_without_an_error_line(
    stub: worker_pb2_grpc.WorkerStub, caplog: pytest.LogCaptureFixture, small_before: int
) -> None:
    """The first write's failure is the case that matters: grpc has not marked the initial
    metadata sent, so a handler that returned normally had grpc send it again with the status,
    which core refuses (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS, logged at ERROR)."""
    caplog.set_level(logging.DEBUG)
    for _ in range(3):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await pull(stub, small_before, oversized=True)
        assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    about_pull = [r for r in caplog.records if "/kvmesh.v1.Worker/PullKv" in r.getMessage()]
    assert [(r.levelname, r.name) for r in about_pull] == [("DEBUG", "kvmesh.grpc_server")] * 3
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert await pull(stub, 3, oversized=False) == [0, 1, 2]
