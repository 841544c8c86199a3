"""Outgoing gRPC channels: one place that sets message limits, trace propagation and the
caller's mesh identity."""

from __future__ import annotations

from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import propagate

from kvmesh.mesh_auth import MeshMember

MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""gRPC message size limit in both directions, on channels and servers (KV chunks stay at or
under 1 MiB)."""

KEEPALIVE_TIME_MS = 10_000
"""How often channels ping their peer."""
PING_TIMEOUT_MS = 5_000
"""How long a channel waits for a ping's answer before it gives the connection up."""

SERVER_KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    # Pings from callers at KEEPALIVE_TIME_MS are welcome, with or without calls or data
    # (grpc's defaults would answer them with GOAWAY "too_many_pings").
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Fail fast on a dead or frozen peer instead of waiting for TCP timeouts: a ping every
    # 10 s that must be answered within 5 s, also on a connection with no call (permit) and
    # while a call sends no data (grpc stops pinging after 2 such pings by default). grpc
    # 1.85 times every ping out by grpc.http2.ping_timeout_ms (default 60 s), keepalive's
    # included, whatever keepalive_timeout_ms says: without it a frozen peer's calls hung
    # 60 s and more. Servers accept this rate (SERVER_KEEPALIVE_OPTIONS).
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", PING_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


Metadata = tuple[tuple[str, str], ...]


def _with_metadata(
    details: grpc.aio.ClientCallDetails, traced: bool, fixed: Metadata
) -> grpc.aio.ClientCallDetails:
    """The call's details with `fixed` entries and (when traced) the current W3C trace
    context (traceparent, tracestate) added."""
    carrier: dict[str, str] = {}
    if traced:
        propagate.inject(carrier)
    if not carrier and not fixed:
        return details
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    for key, value in (*fixed, *carrier.items()):
        metadata.add(key, value)
    return details._replace(metadata=metadata)


class _Interceptor:
    def __init__(self, traced: bool, fixed: Metadata) -> None:
        self._traced = traced
        self._fixed = fixed

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return _with_metadata(details, self._traced, self._fixed)


class _UnaryUnary(_Interceptor, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_Interceptor, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_Interceptor, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: AsyncIterable[Any],
    ) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_Interceptor, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: AsyncIterable[Any],
    ) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


def call_interceptors(traced: bool, fixed: Metadata = ()) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add `fixed` entries (the caller's mesh identity) to every call's
    metadata and, when traced, the caller's trace context, recording no span: the callee's
    server span becomes a child of the span the call was made in.

    OpenTelemetry's client interceptors also recorded a client span per call and wrapped each
    streamed message: 0.1-0.35 ms more per call, on every hop of a request's first token,
    for a span the server's already covers. (grpc.aio files each interceptor under the first
    call kind it implements, hence one per kind.)"""
    if not traced and not fixed:
        return []
    return [
        kind(traced, fixed) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
    ]


def insecure_channel(address: str, traced: bool = True) -> grpc.aio.Channel:
    """A plaintext asyncio channel to a kvmesh service that carries the W3C traceparent.

    Background polling (health checks, Stats refreshes) passes traced=False: it belongs to
    no request, and a trace per poll would bury the requests' traces."""
    return grpc.aio.insecure_channel(
        address, options=CHANNEL_OPTIONS, interceptors=call_interceptors(traced) or None
    )


def member_channel(
    address: str, member: MeshMember | None, traced: bool = True
) -> grpc.aio.Channel:
    """A channel on which `member` calls another service of its stack: over mutual TLS with
    its certificate when it has one, else with its member token in every call's metadata
    (None: as insecure_channel)."""
    if member is None:
        return insecure_channel(address, traced)
    interceptors = call_interceptors(traced, member.call_metadata()) or None
    if member.tls is None:
        return grpc.aio.insecure_channel(
            address, options=CHANNEL_OPTIONS, interceptors=interceptors
        )
    return grpc.aio.secure_channel(
        address,
        member.tls.channel_credentials(),
        options=CHANNEL_OPTIONS,
        interceptors=interceptors,
    )
