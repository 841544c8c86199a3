"""Tracing set-up: the JSON-lines trace file."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult

from kvmesh import telemetry


def test_trace_file_spans_are_written_off_the_callers_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The process-wide provider stays as it is: the test uses the one it gets back.
    monkeypatch.setattr(trace, "set_tracer_provider", lambda provider: None)
    exporting_threads: list[threading.Thread] = []
    export = telemetry.JsonLinesSpanExporter.export

    def recording_export(
        self: telemetry.JsonLinesSpanExporter, spans: Sequence[ReadableSpan]
    ) -> SpanExportResult:
        exporting_threads.append(threading.current_thread())
        return export(self, spans)

    monkeypatch.setattr(telemetry.JsonLinesSpanExporter, "export", recording_export)
    path = tmp_path / "spans.jsonl"
    provider = telemetry.setup_tracing("test", {telemetry.TRACE_FILE_ENV: str(path)})
    assert provider is not None
    with provider.get_tracer(__name__).start_as_current_span("work"):
        pass
    deadline = time.monotonic() + 5.0
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # the processor's thread writes the batch within its delay
    provider.shutdown()

    assert exporting_threads and threading.current_thread() not in exporting_threads
    (span,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert span["name"] == "work"
    assert span["resource"]["attributes"]["service.name"] == "test"
