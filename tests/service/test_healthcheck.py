"""`python -m kvmesh.healthcheck` against a real gRPC health service on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.healthcheck import main
from kvmesh.tls import CA_CERT, StackAuthority, TlsFiles
from tests.procs import REPO_ROOT

SERVICE = "kvmesh.v1.Cache"


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def test_serving_server_exits_zero(health_server: tuple[str, health.HealthServicer]) -> None:
    address, _ = health_server
    assert main([address]) == 0
    assert main([address, "--service", SERVICE]) == 0


def test_not_serving_exits_one_and_says_so(
    health_server: tuple[str, health.HealthServicer], capsys: pytest.CaptureFixture[str]
) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main([address]) == 1
    assert f"{address}: NOT_SERVING" in capsys.readouterr().err


def test_unknown_service_exits_one(
    health_server: tuple[str, health.HealthServicer], capsys: pytest.CaptureFixture[str]
) -> None:
    address, _ = health_server
    assert main([address, "--service", "kvmesh.v1.Nothing"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_nothing_listening_exits_one(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    assert main([f"127.0.0.1:{free_port}", "--timeout-s", "1"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_module_entry_point_sets_the_exit_status(
    health_server: tuple[str, health.HealthServicer],
) -> None:
    """What the container health check runs: the process exit status is the verdict."""
    address, servicer = health_server
    command = [sys.executable, "-m", "kvmesh.healthcheck", address]
    assert subprocess.run(command, cwd=REPO_ROOT, timeout=30).returncode == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert subprocess.run(command, cwd=REPO_ROOT, timeout=30).returncode == 1


@pytest.fixture
def mutual_tls_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A health service that, like an internal service over TLS, takes only callers with a
    certificate of its CA; the folder holds a member's certificate as `kvmesh up --tls` makes."""
    authority = StackAuthority.open(tmp_path)
    server_files = authority.issue("cache", "cache:cache", ["127.0.0.1"])
    authority.issue("router", "router:router", ["127.0.0.1"])
    tls = TlsFiles.load(server_files.cert, server_files.key, authority.ca_file)
    assert tls is not None
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(True))
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield f"127.0.0.1:{port}", tmp_path
    server.stop(None)


def test_over_mutual_tls_the_probe_shows_a_certificate_from_flags_or_environment(
    mutual_tls_server: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    address, folder = mutual_tls_server
    files = {
        "cert": folder / "router.pem",
        "key": folder / "router-key.pem",
        "ca": folder / CA_CERT,
    }
    flags = [arg for name, path in files.items() for arg in (f"--tls-{name}-file", str(path))]
    assert main([address, *flags], environ={}) == 0
    environ = {f"KVMESH_HEALTHCHECK_TLS_{name.upper()}_FILE": str(p) for name, p in files.items()}
    assert main([address], environ=environ) == 0
    # Without a certificate the server takes no connection: the CA alone is not enough.
    assert main([address, "--tls-ca-file", str(files["ca"]), "--timeout-s", "2"], environ={}) == 1
    assert main([address, "--timeout-s", "2"], environ={}) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_a_missing_tls_file_is_one_line_not_a_traceback(
    mutual_tls_server: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    address, folder = mutual_tls_server
    missing = ["--tls-cert-file", str(folder / "none.pem"), "--tls-key-file", str(folder / "x")]
    assert main([address, *missing], environ={}) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{address}: TLS files:") and "Traceback" not in err
