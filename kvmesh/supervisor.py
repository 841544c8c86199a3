"""Runs a stack plan as local child processes: `kvmesh up`.

Children start in dependency order (cache and workers together, then the router, then the
gateway), each considered up once it prints its ready line. Their output is shown line by
line behind their name. Ctrl-C or SIGTERM stops them in reverse order; a child that fails
to start stops the rest. Children die with the supervisor even when it is killed outright
(each asks for PR_SET_PDEATHSIG itself: kvmesh.supervised), so no kvmesh process is ever left
behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.grpc_server import READY_PREFIX, bind_error
from kvmesh.stack import StackService
from kvmesh.supervised import SUPERVISOR_PID_ENV

READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 20.0
TAIL_LINES = 15

Printer = Callable[[str, str], None]


class StartupError(RuntimeError):
    """A service could not start; the message names it and says why."""


def service_environment(
    service: StackService, caller: Mapping[str, str], overrides: Mapping[str, str]
) -> dict[str, str]:
    """A child's environment: the service's own defaults, then the caller's environment (a
    variable the user set wins), then the supervisor's overrides."""
    return {**dict(service.env), **caller, "PYTHONUNBUFFERED": "1", **overrides}


def port_in_use(host: str, port: int) -> bool:
    """True when host:port cannot be listened on (something already listens there)."""
    return bind_error(host, port) is not None


@dataclass
class Child:
    """One running service process and what it printed."""

    service: StackService
    process: asyncio.subprocess.Process
    ready: asyncio.Future[dict[str, object]]
    tail: list[str] = field(default_factory=list)
    pump: asyncio.Task[None] | None = None


@dataclass
class Supervisor:
    """Starts, watches and stops the processes of one stack."""

    printer: Printer
    env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable
    children: list[Child] = field(default_factory=list)

    def check_ports(self, services: Sequence[StackService]) -> None:
        """StartupError naming the first service whose ports are taken."""
        for service in services:
            ports = [("gRPC", service.port), ("metrics", service.metrics_port)]
            if service.http_port is not None:
                ports.append(("HTTP", service.http_port))
            for kind, port in ports:
                if port > 0 and port_in_use(service.host, port):
                    raise StartupError(
                        f"{service.name}: {kind} port {service.host}:{port} is already in use"
                        " (another stack? start this one with --port-offset N, which moves"
                        " every port)"
                    )

    async def spawn(self, service: StackService) -> Child:
        """Starts one service; its output flows to the printer."""
        process = await asyncio.create_subprocess_exec(
            *service.command(self.python),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            env=service_environment(
                service, os.environ, {**self.env, SUPERVISOR_PID_ENV: str(os.getpid())}
            ),
            # Own session: a terminal's Ctrl-C reaches only the supervisor, which stops the
            # children in order (gateway first) instead of all at once.
            start_new_session=True,
        )
        child = Child(service, process, asyncio.get_running_loop().create_future())
        child.pump = asyncio.create_task(self._pump(child))
        self.children.append(child)
        return child

    async def _pump(self, child: Child) -> None:
        assert child.process.stdout is not None
        async for raw in child.process.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            child.tail = [*child.tail[-(TAIL_LINES - 1) :], line]
            if line.startswith(READY_PREFIX) and not child.ready.done():
                child.ready.set_result(json.loads(line[len(READY_PREFIX) :]))
                continue
            self.printer(child.service.name, line)
        if not child.ready.done():
            child.ready.set_exception(
                StartupError(
                    f"{child.service.name} exited before it was ready"
                    f" (exit code {await child.process.wait()}); its last lines:\n  "
                    + "\n  ".join(child.tail)
                )
            )

    async def wait_ready(self, children: Sequence[Child], limit_s: float = READY_TIMEOUT_S) -> None:
        """Returns once every child printed its ready line; StartupError otherwise."""
        try:
            async with asyncio.timeout(limit_s):
                await asyncio.gather(*(c.ready for c in children))
        except TimeoutError:
            late = [c.service.name for c in children if not c.ready.done()]
            raise StartupError(f"not ready after {limit_s:.0f}s: {', '.join(late)}") from None

    async def start_all(self, waves: Sequence[Sequence[StackService]]) -> None:
        """Starts each wave once the previous one is ready."""
        for wave in waves:
            started = [await self.spawn(service) for service in wave]
            await self.wait_ready(started)

    async def stop(self, child: Child, limit_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (graceful drain), then SIGKILL after `limit_s`."""
        if child.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(child.process.wait(), limit_s)
            except TimeoutError:
                self.printer(child.service.name, f"did not stop in {limit_s:.0f}s: killed")
                child.process.kill()
                await child.process.wait()
        if child.pump is not None:
            await child.pump
        with contextlib.suppress(ValueError):
            self.children.remove(child)
        return child.process.returncode or 0

    async def stop_all(self) -> None:
        """Stops every child, newest first (the gateway before the workers it calls)."""
        for child in reversed(list(self.children)):
            await self.stop(child)

    async def restart(self, child: Child, delay_s: float) -> Child:
        """Starts `child`'s service again (same ports) after `delay_s`, once it has exited;
        StartupError when the new process is not ready in time."""
        if child.pump is not None:
            await child.pump
        with contextlib.suppress(ValueError):
            self.children.remove(child)
        await asyncio.sleep(delay_s)
        fresh = await self.spawn(child.service)
        await self.wait_ready([fresh])
        return fresh

    async def first_exit(self) -> Child:
        """The first child to exit on its own."""
        waits = {asyncio.ensure_future(c.process.wait()): c for c in self.children}
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return waits[next(iter(done))]
