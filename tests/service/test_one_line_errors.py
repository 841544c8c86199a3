"""A user's mistake gets one line naming it and a non-zero exit, never a traceback.

Each command is run as a user would type it (a subprocess); log lines a service prints while
starting are logs, not the answer, so they are not counted.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import REPO_ROOT, ServiceProcess, start_service

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING) ")
"""A service's own log line (kvmesh.grpc_server.configure_logging's format), not the error."""

KVMESH = [sys.executable, "-m", "kvmesh.cli"]


@pytest.fixture(scope="module")
def listening_port() -> Iterator[int]:
    """A port something already listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.fixture(scope="module")
def closed_port() -> int:
    """A port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.fixture(scope="module")
def cache_process() -> Iterator[ServiceProcess]:
    service = start_service("services.cache", ["--port", "0", "--metrics-port", "-1"])
    yield service
    service.kill()


def run_mistake(command: list[str], cwd: Path = REPO_ROOT) -> str:
    """Runs `command`, asserts it failed with one line and no traceback; returns that line."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}  # this checkout, whatever the cwd
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    answer = [line for line in result.stderr.splitlines() if not LOG_LINE.match(line)]
    assert result.returncode != 0, f"{command} exited 0: {result.stderr}"
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert len(answer) == 1, f"{command} printed {len(answer)} lines: {result.stderr}"
    return answer[0]


def test_status_without_a_stack(closed_port: int) -> None:
    line = run_mistake([*KVMESH, "status", "--router", f"127.0.0.1:{closed_port}"])
    assert line.startswith("kvmesh: UNAVAILABLE: no router answers")


def test_status_pointed_at_another_service(cache_process: ServiceProcess) -> None:
    line = run_mistake([*KVMESH, "status", "--router", cache_process.address])
    assert line.startswith("kvmesh: UNIMPLEMENTED:") and "not a kvmesh router" in line


@pytest.mark.parametrize("flag", ["--max-tokens", "--seed"])
def test_generate_with_a_negative_number(flag: str, closed_port: int) -> None:
    target = f"127.0.0.1:{closed_port}"
    line = run_mistake([*KVMESH, "generate", "--target", target, flag, "-1", "hello"])
    field = flag.removeprefix("--").replace("-", "_")
    assert line.startswith(f"kvmesh: INVALID_ARGUMENT: sampling.{field}: must be between 0")


@pytest.mark.parametrize("delta", ["abc", "0", "+0"])
def test_scale_by_a_non_number_or_zero(delta: str, tmp_path: Path) -> None:
    line = run_mistake([*KVMESH, "scale", "decode", delta, "--state-dir", str(tmp_path)])
    assert line.startswith("kvmesh scale: error: argument delta:")


def test_router_without_a_pools_file(tmp_path: Path) -> None:
    line = run_mistake([sys.executable, "-m", "services.router", "--port", "0"], cwd=tmp_path)
    assert line.startswith("router: error: cannot read pools file pools.yaml")


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_service_on_a_port_in_use(flag: str, listening_port: int) -> None:
    command = [sys.executable, "-m", "services.cache", "--port", "0", flag, str(listening_port)]
    line = run_mistake(command)
    assert line == (
        f"cache: error: cannot listen on 127.0.0.1:{listening_port}: the port is in use "
        f"(choose another with {flag})"
    )


def test_gateway_whose_http_port_is_in_use(listening_port: int) -> None:
    command = [sys.executable, "-m", "services.admission", "--port", "0", "--metrics-port", "-1"]
    line = run_mistake([*command, "--http-port", str(listening_port)])
    assert line == (
        f"admission: error: cannot listen on 127.0.0.1:{listening_port}: the port is in use "
        "(choose another with --http-port)"
    )


def test_worker_with_an_unknown_model() -> None:
    command = [sys.executable, "-m", "services.worker", "--model", "nosuch", "--port", "0"]
    line = run_mistake(command)
    assert line.startswith("worker: error: model 'nosuch' not found")


def test_up_with_an_unknown_model_starts_nothing(tmp_path: Path) -> None:
    command = [*KVMESH, "up", "--model", "nosuch", "--port-offset", "3"]
    line = run_mistake(command, cwd=tmp_path)
    assert line.startswith("kvmesh up failed: model 'nosuch' not found")
    assert not (tmp_path / ".kvmesh").exists(), "it wrote state for a stack it did not start"
