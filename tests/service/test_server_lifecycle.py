"""Every service runs through kvmesh.grpc_server.serve(): health, reflection, metrics,
unknown methods, and graceful SIGTERM — checked on a real subprocess."""

from __future__ import annotations

import queue
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from tests.procs import ServiceProcess, start_service

GRACE_S = 3.0


@pytest.fixture
def cache_process() -> Iterator[ServiceProcess]:
    service = start_service(
        "services.cache", ["--port", "0", "--metrics-port", "0", "--grace-s", str(GRACE_S)]
    )
    yield service
    service.kill()


def test_health_answers_serving(cache_process: ServiceProcess) -> None:
    with grpc.insecure_channel(cache_process.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "kvmesh.v1.Cache"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_and_describes_the_service(cache_process: ServiceProcess) -> None:
    with grpc.insecure_channel(cache_process.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert "kvmesh.v1.Cache" in services
        assert "grpc.health.v1.Health" in services
        described = database.FindFileContainingSymbol("kvmesh.v1.Cache")
        assert described.name == "kvmesh/v1/cache.proto"
        assert [m.name for m in described.service[0].method] == [
            "Lookup",
            "Store",
            "Invalidate",
            "Stats",
        ]


def test_reflection_answers_v1_as_well_as_v1alpha(cache_process: ServiceProcess) -> None:
    """Clients that speak only grpc.reflection.v1 (newer grpcurl) find the same services."""
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    with grpc.insecure_channel(cache_process.address) as channel:
        for name in (
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        ):
            info = channel.stream_stream(
                f"/{name}/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            (reply,) = list(info(iter([request]), timeout=5))
            listed = {service.name for service in reply.list_services_response.service}
            assert {"kvmesh.v1.Cache", "grpc.health.v1.Health"} <= listed, name


def test_metrics_port_answers(cache_process: ServiceProcess) -> None:
    assert cache_process.metrics_port
    url = f"http://127.0.0.1:{cache_process.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        body = reply.read().decode()
    assert reply.status == 200
    assert "kvmesh_rpc_errors_total" in body
    assert "process_cpu_seconds_total" in body


def test_unknown_method_is_unimplemented_and_server_stays_up(
    cache_process: ServiceProcess,
) -> None:
    with grpc.insecure_channel(cache_process.address) as channel:
        bogus = channel.unary_unary("/kvmesh.v1.Cache/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as caught:
            bogus(b"", timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED  # type: ignore[attr-defined]
        garbage = channel.unary_unary("/kvmesh.v1.Cache/Lookup")
        with pytest.raises(grpc.RpcError) as caught:
            garbage(b"\xff\xff\xff\xff", timeout=5)  # not a LookupRequest
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "could not be decoded" in (caught.value.details() or "")  # type: ignore[attr-defined]
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert cache_process.proc.poll() is None


def test_sigterm_flips_health_then_exits_within_grace(cache_process: ServiceProcess) -> None:
    statuses: queue.Queue[int] = queue.Queue()
    channel = grpc.insecure_channel(cache_process.address)
    watch = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service="kvmesh.v1.Cache")
    )

    def follow() -> None:
        try:
            for update in watch:
                statuses.put(update.status)
        except grpc.RpcError:
            pass

    threading.Thread(target=follow, daemon=True).start()
    assert statuses.get(timeout=5) == health_pb2.HealthCheckResponse.SERVING
    sent = time.monotonic()
    cache_process.proc.send_signal(signal.SIGTERM)
    assert statuses.get(timeout=5) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert cache_process.proc.wait(timeout=GRACE_S + 5) == 0
    assert time.monotonic() - sent < GRACE_S + 2
    channel.close()


@pytest.mark.parametrize(
    ("metrics_host", "reaches_other_address"), [("", True), ("127.0.0.1", False)]
)
def test_metrics_can_stay_on_loopback_while_grpc_listens_everywhere(
    metrics_host: str, reaches_other_address: bool
) -> None:
    args = ["--host", "0.0.0.0", "--port", "0", "--metrics-port", "0"]
    if metrics_host:
        args += ["--metrics-host", metrics_host]
    service = start_service("services.cache", args)
    try:
        assert service.metrics_port
        # 127.0.0.2 stands for any address but 127.0.0.1 (Linux routes all of 127/8 locally).
        with urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics") as reply:
            assert reply.status == 200
        try:
            urllib.request.urlopen(f"http://127.0.0.2:{service.metrics_port}/metrics", timeout=5)
            reached = True
        except OSError:
            reached = False
        assert reached == reaches_other_address
    finally:
        service.kill()
