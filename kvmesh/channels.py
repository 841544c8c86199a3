"""Outgoing gRPC channels: one place that sets message limits and trace propagation."""

from __future__ import annotations

import grpc
from opentelemetry.instrumentation.grpc import aio_client_interceptors

from kvmesh.grpc_server import MAX_MESSAGE_BYTES

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Fail fast on a dead peer instead of waiting for TCP timeouts.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


def insecure_channel(address: str, traced: bool = True) -> grpc.aio.Channel:
    """An asyncio channel to another kvmesh service that carries the W3C traceparent.

    Background polling (health checks, Stats refreshes) passes traced=False: it belongs to
    no request, and a trace per poll would bury the requests' traces."""
    return grpc.aio.insecure_channel(
        address,
        options=CHANNEL_OPTIONS,
        interceptors=aio_client_interceptors() if traced else None,
    )
