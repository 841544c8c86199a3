"""The gateway's gRPC surface in-process, with no router behind it: errors that need none."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.rpc_status import error_from_rpc
from kvmesh.v1 import common_pb2, gateway_pb2
from tests.service.admission.conftest import StartGateway


@pytest.fixture
async def gateway(start_gateway: StartGateway, closed_port: int) -> str:
    return await start_gateway(["--router", f"127.0.0.1:{closed_port}"])


async def generate_raw(address: str, *messages: bytes) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(
            "/kvmesh.v1.Gateway/Generate",
            request_serializer=lambda data: data,
            response_deserializer=common_pb2.GenerateEvent.FromString,
        )(iter(messages), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in call:
                pass
        return raised.value


def request_bytes(**fields: object) -> bytes:
    request = gateway_pb2.GenerateRequest(**fields)  # type: ignore[arg-type]
    return gateway_pb2.GenerateClientMessage(request=request).SerializeToString()


async def test_unparseable_requests_are_invalid_arguments(gateway: str) -> None:
    bad_utf8 = request_bytes(model="abc").replace(b"abc", b"a\xffc")
    error = await generate_raw(gateway, bad_utf8)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in (error.details() or "")
    assert error_from_rpc(error).field == "request"
    for messages in ([b"\xff\xff\xff"], []):
        error = await generate_raw(gateway, *messages)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_cancel_before_the_request_is_invalid(gateway: str) -> None:
    cancel = gateway_pb2.GenerateClientMessage(cancel=common_pb2.Cancel()).SerializeToString()
    error = await generate_raw(gateway, cancel)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first message" in (error.details() or "")


async def test_an_unreachable_router_is_unavailable_not_a_crash(gateway: str) -> None:
    error = await generate_raw(gateway, request_bytes(prompt=common_pb2.Prompt(text="hi")))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "router" in (error.details() or "")
    # Validation that needs no model still answers first.
    error = await generate_raw(gateway, request_bytes(priority=9))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
