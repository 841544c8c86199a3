"""The process supervisor behind `kvmesh up`: readiness, failures named, clean stops."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.stack import StackService
from kvmesh.supervised import SUPERVISOR_PID_ENV
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


async def test_children_start_while_the_supervisor_has_grpc_calls_in_flight() -> None:
    """A child forked while this process's gRPC calls are in flight ran gRPC's fork handlers,
    and about one in five aborted before exec (grpc/grpc#43055); every child must start."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)

    async def keep_calling() -> None:
        while True:
            await stub.Check(health_pb2.HealthCheckRequest())

    callers = [asyncio.create_task(keep_calling()) for _ in range(4)]
    supervisor, _ = collecting_supervisor()
    # `python -m site` prints its paths and exits 0: a child that runs at all succeeds.
    quick = StackService("quick", "site", (), "127.0.0.1", 1, 2)
    codes = []
    try:
        for _ in range(40):
            child = await supervisor.spawn(quick)
            codes.append(await child.process.wait())
            assert child.pump is not None
            await child.pump
            assert isinstance(child.ready.exception(), StartupError)  # it never said ready
    finally:
        for caller in callers:
            caller.cancel()
        await channel.close()
        await server.stop(None)
        await supervisor.stop_all()
    assert codes == [0] * 40


SUPERVISOR_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from kvmesh.stack import StackService
    from kvmesh.supervisor import Supervisor

    async def main() -> None:
        supervisor = Supervisor(printer=lambda name, line: None)
        port, metrics = int(sys.argv[1]), int(sys.argv[2])
        args = ("--port", str(port), "--metrics-port", str(metrics))
        await supervisor.start_all([[StackService("cache", "services.cache", args, "127.0.0.1",
                                                  port, metrics)]])
        print(supervisor.children[0].process.pid, flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


def test_children_die_when_the_supervisor_is_killed_outright() -> None:
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR_SCRIPT, str(free_port()), str(free_port())],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert supervisor.stdout is not None
        child = int(supervisor.stdout.readline())
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.wait()
        deadline = time.monotonic() + 30
        while pid_alive(child):
            assert time.monotonic() < deadline, "the service outlived its killed supervisor"
            time.sleep(0.1)
    finally:
        supervisor.kill()
        supervisor.wait()


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (not a zombie: its new parent, init, reaps it at once)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1", "cache: error: the supervisor (pid 1) that started it has exited"),
        ("soon", f"cache: error: {SUPERVISOR_PID_ENV} must be a process id, got 'soon'"),
    ],
)
def test_a_service_whose_supervisor_is_gone_exits_with_one_line(value: str, message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.cache", "--port", str(free_port())],
        env={**os.environ, SUPERVISOR_PID_ENV: value},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr.strip()) == (2, message)
