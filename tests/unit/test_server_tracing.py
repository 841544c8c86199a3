"""server_span: the span of one request that shares its call with others (GenerateMany)."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kvmesh import server_tracing
from kvmesh.errors import ResourceExhausted
from kvmesh.server_tracing import server_span

METHOD = "/kvmesh.v1.Worker/Generate"
TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CALLER_SPAN = 0x00F067AA0BA902B7
CARRIER = {"traceparent": f"00-{TRACE_ID:032x}-{CALLER_SPAN:016x}-01"}


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(server_tracing, "_tracer", provider.get_tracer(__name__))
    return exporter


def test_the_span_continues_the_carried_trace_and_is_current_inside(
    exporter: InMemorySpanExporter,
) -> None:
    with server_span(METHOD, CARRIER) as span:
        assert trace.get_current_span() is span
    (finished,) = exporter.get_finished_spans()
    assert finished.name == METHOD and finished.kind == SpanKind.SERVER
    assert finished.context.trace_id == TRACE_ID
    assert finished.parent is not None and finished.parent.span_id == CALLER_SPAN
    assert finished.status.status_code == StatusCode.UNSET


def test_a_kvmesh_error_sets_the_status_its_own_call_would_have(
    exporter: InMemorySpanExporter,
) -> None:
    with pytest.raises(ResourceExhausted), server_span(METHOD, CARRIER):
        raise ResourceExhausted("KV cache cannot hold the request")
    (finished,) = exporter.get_finished_spans()
    assert finished.status.status_code == StatusCode.ERROR
    assert finished.status.description == "KV cache cannot hold the request"
    assert finished.attributes is not None
    assert finished.attributes["rpc.grpc.status_code"] == 8  # RESOURCE_EXHAUSTED


def test_a_cancelled_generation_is_no_error_and_a_bug_is(
    exporter: InMemorySpanExporter,
) -> None:
    with pytest.raises(asyncio.CancelledError), server_span(METHOD, {}):
        raise asyncio.CancelledError
    with pytest.raises(KeyError), server_span(METHOD, {}):
        raise KeyError("bug")
    cancelled, bug = exporter.get_finished_spans()
    assert cancelled.status.status_code == StatusCode.UNSET
    assert cancelled.parent is None  # no trace context came with it: a trace of its own
    assert bug.status.status_code == StatusCode.ERROR
    assert [event.name for event in bug.events] == ["exception"]
