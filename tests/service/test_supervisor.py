"""The process supervisor behind `kvmesh up`: readiness, failures named, clean stops."""

from __future__ import annotations

import socket

import pytest

from kvmesh.stack import StackService
from kvmesh.supervisor import StartupError, Supervisor


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cache_service(name: str = "cache") -> StackService:
    port, metrics = free_port(), free_port()
    args = ("--port", str(port), "--metrics-port", str(metrics))
    return StackService(name, "services.cache", args, "127.0.0.1", port, metrics)


def collecting_supervisor() -> tuple[Supervisor, list[tuple[str, str]]]:
    lines: list[tuple[str, str]] = []
    return Supervisor(printer=lambda name, line: lines.append((name, line))), lines


async def test_starts_prefixes_output_and_stops_cleanly() -> None:
    supervisor, lines = collecting_supervisor()
    service = cache_service()
    await supervisor.start_all([[service]])
    child = supervisor.children[0]
    assert child.ready.result()["port"] == service.port
    assert await supervisor.stop(child) == 0
    assert supervisor.children == []
    assert any(name == "cache" and "received SIGTERM" in line for name, line in lines)


async def test_taken_port_is_named_before_anything_starts() -> None:
    supervisor, _ = collecting_supervisor()
    service = cache_service()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", service.port))
        squatter.listen()
        with pytest.raises(StartupError, match=rf"cache: gRPC port 127.0.0.1:{service.port} is"):
            supervisor.check_ports([service])
    assert supervisor.children == []


async def test_a_service_that_dies_at_start_is_named_with_its_last_lines() -> None:
    supervisor, _ = collecting_supervisor()
    broken = StackService("broken", "services.cache", ("--port", "not-a-port"), "127.0.0.1", 1, 2)
    with pytest.raises(StartupError, match="broken exited before it was ready") as caught:
        await supervisor.start_all([[broken]])
    assert "port: expected int" in str(caught.value)
    await supervisor.stop_all()
    assert supervisor.children == []
