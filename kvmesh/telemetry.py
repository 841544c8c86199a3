"""OpenTelemetry set-up for a kvmesh process.

Tracing is configured from the standard OTEL_* variables: an OTLP exporter when
OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set or
OTEL_TRACES_EXPORTER=otlp, and additionally a JSON-lines file when KVMESH_TRACE_FILE names
one. With neither, spans are not recorded, but the W3C traceparent still passes through
every hop, so a caller's trace continues downstream.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

log = logging.getLogger(__name__)

T = TypeVar("T")

TRACE_FILE_ENV = "KVMESH_TRACE_FILE"
"""Environment variable naming a JSON-lines file that receives every finished span."""
TRACE_FILE_DELAY_MS = 200
"""Most time a finished span waits before it is written to the trace file (and at exit)."""


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span as one JSON line; several processes may share the file."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(
            json.dumps(json.loads(span.to_json()), separators=(",", ":")) + "\n" for span in spans
        )
        with self._lock, open(self._path, "a", encoding="utf-8") as out:
            # One write per batch: O_APPEND keeps lines from different processes whole.
            out.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def _otlp_requested(environ: Mapping[str, str]) -> bool:
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").lower()
    if exporter == "none":
        return False
    return exporter == "otlp" or any(
        environ.get(name)
        for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def setup_tracing(
    service_name: str, environ: Mapping[str, str] | None = None
) -> TracerProvider | None:
    """Installs the global tracer provider for this process; None when nothing exports."""
    environ = os.environ if environ is None else environ
    otlp = _otlp_requested(environ)
    trace_file = environ.get(TRACE_FILE_ENV)
    if not otlp and not trace_file:
        return None
    attributes: dict[str, str] = {SERVICE_NAME: environ.get("OTEL_SERVICE_NAME", service_name)}
    if "service.instance.id" not in environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        # Several processes share a service name (prefill and decode workers): tell them apart.
        attributes[SERVICE_INSTANCE_ID] = f"{socket.gethostname()}:{os.getpid()}"
    resource = Resource.create(attributes)
    provider = TracerProvider(resource=resource)
    if otlp:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        log.info("tracing: OTLP export enabled")
    if trace_file:
        # Batched on the processor's thread: an export per span, on the event loop, would add
        # a JSON round trip and a file write to every hop of every request.
        exporter = JsonLinesSpanExporter(Path(trace_file))
        provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=TRACE_FILE_DELAY_MS)
        )
        log.info("tracing: writing spans to %s", trace_file)
    trace.set_tracer_provider(provider)
    return provider


def tracer(name: str) -> trace.Tracer:
    """The tracer for a kvmesh module."""
    return trace.get_tracer(name)


async def in_span(span: trace.Span, events: AsyncIterator[T]) -> AsyncGenerator[T]:
    """`events`, each step advanced with `span` current (spans started meanwhile are its
    children); ends the span with the stream.

    The span is current for one step at a time, never across a yield: a stream closed from
    another context (gRPC finalizing the handler of a cancelled call) would otherwise detach a
    context attached in this one, which OpenTelemetry logs as "Failed to detach context" at
    ERROR with a traceback."""
    try:
        while True:
            with trace.use_span(span, end_on_exit=False):
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    return
            yield event
    finally:
        closer = getattr(events, "aclose", None)
        if closer is not None:
            with trace.use_span(span, end_on_exit=False):
                await closer()
        span.end()
