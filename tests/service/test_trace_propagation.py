"""kvmesh's channels carry the caller's W3C trace context to a real server on loopback,
without client spans of their own."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.channels import insecure_channel

SERVICE = "kvmesh.test.Echo"


class Recorder:
    """A server whose two methods (unary, bidi stream) record each call's traceparent."""

    def __init__(self) -> None:
        self.traceparents: list[str | None] = []

    def _record(self, context: grpc.aio.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        value = metadata.get("traceparent")
        self.traceparents.append(value if isinstance(value, str) else None)

    async def unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self._record(context)
        return request

    async def stream(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        self._record(context)
        async for request in requests:
            yield request

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
                "Stream": grpc.stream_stream_rpc_method_handler(self.stream),
            },
        )


@pytest.fixture
async def echo() -> AsyncIterator[tuple[str, Recorder]]:
    recorder = Recorder()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((recorder.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}", recorder
    await server.stop(None)


async def calls(address: str, traced: bool) -> None:
    async with insecure_channel(address, traced) as channel:
        assert await channel.unary_unary(f"/{SERVICE}/Unary")(b"x") == b"x"
        call = channel.stream_stream(f"/{SERVICE}/Stream")()
        await call.write(b"y")
        await call.done_writing()
        assert [reply async for reply in call] == [b"y"]


async def test_calls_carry_the_callers_span_as_parent_and_record_no_span_of_their_own(
    echo: tuple[str, Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, recorder = echo
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # As a service's own provider would be (the process-wide one is restored afterwards).
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    with provider.get_tracer(__name__).start_as_current_span("caller") as span:
        await calls(address, traced=True)
        context = span.get_span_context()
    parent = f"00-{context.trace_id:032x}-{context.span_id:016x}-"  # then the trace flags
    assert [(value or "")[: len(parent)] for value in recorder.traceparents] == [parent, parent]
    assert [s.name for s in exporter.get_finished_spans()] == ["caller"]


async def test_untraced_channels_carry_no_trace_context(echo: tuple[str, Recorder]) -> None:
    address, recorder = echo
    with TracerProvider().get_tracer(__name__).start_as_current_span("poller"):
        await calls(address, traced=False)
    assert recorder.traceparents == [None, None]
