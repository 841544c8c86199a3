"""Stand-ins for the OpenTelemetry Collector and Jaeger of docker-compose.yml, for machines
that reach no container registry (make test-compose). Test infrastructure, not a trace store.

  otlp.py collector --config=FILE   the collector's command line: listens where FILE's
      receivers.otlp.protocols.grpc.endpoint says, and sends every OTLP/gRPC trace export on
      to each `otlp` exporter of its traces pipeline (insecure, as the file says), logging one
      line per export (its `debug` exporter). The batch processor is not imitated: each export
      goes on as it comes.
  otlp.py jaeger --set=receivers.otlp.protocols.grpc.endpoint=ADDR ...   Jaeger's command
      line: receives OTLP/gRPC trace exports there, keeps the latest MAX_SPANS spans in memory
      and answers a subset of Jaeger's query API on QUERY_PORT (16686):
        GET /api/services                           {"data": [service names]}
        GET /api/traces?service=S&tags={"k":"v"}    the traces with a span of S carrying
                                                    those tags, in Jaeger's JSON shape
        GET /api/traces/TRACE_ID                    one trace
      Other --set options (OTLP over HTTP) are read and not served.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
from collections import deque
from collections.abc import Iterable
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import grpc
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

log = logging.getLogger("otlp-standin")

MAX_SPANS = 100_000
QUERY_PORT = 16686
GRPC_ENDPOINT_KEY = "receivers.otlp.protocols.grpc.endpoint"
ExportRequest = trace_service_pb2.ExportTraceServiceRequest


def plain(value: AnyValue) -> Any:
    """An OTLP attribute value as JSON (strings, numbers, booleans; others as text)."""
    kind = value.WhichOneof("value")
    return (
        str(value).strip()
        if kind in (None, "array_value", "kvlist_value")
        else getattr(value, kind)
    )


def tags(attributes: Iterable[KeyValue]) -> list[dict[str, Any]]:
    return [{"key": kv.key, "value": plain(kv.value)} for kv in attributes]


class SpanStore:
    """The latest MAX_SPANS spans, each as (service name, resource tags, Jaeger span)."""

    def __init__(self) -> None:
        self._spans: deque[tuple[str, list[dict[str, Any]], dict[str, Any]]] = deque(
            maxlen=MAX_SPANS
        )
        self._lock = threading.Lock()

    def add(self, request: ExportRequest) -> int:
        added = []
        for resource_spans in request.resource_spans:
            resource = tags(resource_spans.resource.attributes)
            service = next((t["value"] for t in resource if t["key"] == "service.name"), "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    added.append((service, resource, jaeger_span(span)))
        with self._lock:
            self._spans.extend(added)
        return len(added)

    def services(self) -> list[str]:
        with self._lock:
            return sorted({service for service, _, _ in self._spans})

    def traces(self, service: str | None, wanted: dict[str, Any], trace_id: str | None) -> list:
        with self._lock:
            spans = list(self._spans)
        matching = {
            span["traceID"]
            for name, _, span in spans
            if (service is None or name == service)
            and (trace_id is None or span["traceID"] == trace_id)
            and all({"key": k, "value": v} in span["tags"] for k, v in wanted.items())
        }
        return [jaeger_trace(t, [s for s in spans if s[2]["traceID"] == t]) for t in matching]


def jaeger_span(span: Any) -> dict[str, Any]:
    trace_id, span_id = span.trace_id.hex(), span.span_id.hex()
    references = (
        [{"refType": "CHILD_OF", "traceID": trace_id, "spanID": span.parent_span_id.hex()}]
        if span.parent_span_id
        else []
    )
    return {
        "traceID": trace_id,
        "spanID": span_id,
        "operationName": span.name,
        "references": references,
        "startTime": span.start_time_unix_nano // 1000,
        "duration": (span.end_time_unix_nano - span.start_time_unix_nano) // 1000,
        "tags": tags(span.attributes),
    }


def jaeger_trace(trace_id: str, spans: list) -> dict[str, Any]:
    """Jaeger's trace JSON: each span names its process, one per distinct resource."""
    processes: dict[str, dict[str, Any]] = {}
    keys: dict[str, str] = {}
    out = []
    for service, resource, span in spans:
        key = json.dumps(resource, sort_keys=True)
        if key not in keys:
            keys[key] = f"p{len(keys) + 1}"
            processes[keys[key]] = {"serviceName": service, "tags": resource}
        out.append({**span, "processID": keys[key]})
    return {"traceID": trace_id, "spans": out, "processes": processes}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """OTLP/gRPC trace exports: kept (jaeger) or sent on (collector)."""

    def __init__(self, store: SpanStore | None, exporters: list[str]) -> None:
        self._store = store
        self._stubs = [
            trace_service_pb2_grpc.TraceServiceStub(grpc.insecure_channel(target))
            for target in exporters
        ]

    def Export(self, request: ExportRequest, context: grpc.ServicerContext) -> Any:
        count = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        if self._store is not None:
            self._store.add(request)
        for stub in self._stubs:
            try:
                stub.Export(request, timeout=10)
            except grpc.RpcError as error:
                # UNAVAILABLE: the exporter retries, as it would against the real collector.
                context.abort(grpc.StatusCode.UNAVAILABLE, f"forwarding failed: {error.code()}")
        log.info("traces: %d spans received", count)
        return trace_service_pb2.ExportTraceServiceResponse()


def serve_queries(store: SpanStore, port: int) -> None:
    class Query(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            if url.path == "/api/services":
                self.answer(200, {"data": store.services()})
            elif url.path == "/api/traces":
                wanted = json.loads(query.get("tags", "{}"))
                self.answer(200, {"data": store.traces(query.get("service"), wanted, None)})
            elif url.path.startswith("/api/traces/"):
                found = store.traces(None, {}, url.path.rsplit("/", 1)[1].lower())
                self.answer(200 if found else 404, {"data": found})
            else:
                self.answer(404, {"errors": [f"{url.path}: not in this stand-in"]})

        def answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    ThreadingHTTPServer(("0.0.0.0", port), Query).serve_forever()


def collector_settings(config_file: str) -> tuple[str, list[str]]:
    """(where to listen, the OTLP exporters' endpoints) of a collector configuration."""
    with open(config_file, encoding="utf-8") as file:
        config = yaml.safe_load(file)
    endpoint = config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    pipeline = config["service"]["pipelines"]["traces"]["exporters"]
    exporters = [
        config["exporters"][name]["endpoint"]
        for name in pipeline
        if name == "otlp" or name.startswith("otlp/")
    ]
    return endpoint, exporters


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["collector", "jaeger"])
    parser.add_argument("--config", help="the collector's configuration file")
    parser.add_argument("--set", action="append", default=[], help="Jaeger's KEY=VALUE settings")
    args = parser.parse_args()
    store = None
    if args.role == "collector":
        endpoint, exporters = collector_settings(args.config)
    else:
        settings = dict(item.split("=", 1) for item in args.set)
        endpoint, exporters, store = settings[GRPC_ENDPOINT_KEY], [], SpanStore()
        threading.Thread(target=serve_queries, args=(store, QUERY_PORT), daemon=True).start()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(store, exporters), server)
    server.add_insecure_port(endpoint)
    server.start()
    # As PID 1 of its container, the process would otherwise ignore `podman stop`'s SIGTERM.
    signal.signal(signal.SIGTERM, lambda *_: server.stop(0))
    log.info("%s stand-in: OTLP/gRPC on %s, sending on to %s", args.role, endpoint, exporters)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
