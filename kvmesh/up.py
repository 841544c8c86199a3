"""`kvmesh up`: the whole mesh as local processes, ready for `kvmesh generate`.

While it runs it listens on a control socket in the state folder, so `kvmesh scale` can add
workers (started, then announced to the router) or drain them (taken out of the router's
rotation, then SIGTERM: the worker turns NOT_SERVING and finishes its in-flight requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvmesh.channels import member_channel
from kvmesh.contracts.model_files import ModelLoadError, resolve_model_path
from kvmesh.control import (
    control_answers,
    serve_control,
    socket_path,
    stack_file,
    write_stack_file,
)
from kvmesh.errors import InvalidArgument, Unavailable
from kvmesh.mesh_auth import OPERATOR_MEMBER_NAME, MeshMember, MeshRole, certificate_name
from kvmesh.mesh_keys import MeshKeys, write_secret_file
from kvmesh.stack import (
    StackOptions,
    StackService,
    certificate_subject,
    member_tls,
    mesh_secret_path,
    plan_stack,
    tls_folder,
    worker_env,
    worker_service,
    write_pools_file,
)
from kvmesh.supervisor import Child, Printer, StartupError, Supervisor
from kvmesh.telemetry import TRACE_FILE_ENV
from kvmesh.tls import CA_CERT, StackAuthority
from kvmesh.v1 import router_pb2, router_pb2_grpc, worker_pb2

RESTARTS_ALLOWED = 3
"""Restarts of one service within RESTART_WINDOW_S before kvmesh up gives up on the stack."""
RESTART_WINDOW_S = 60.0
FIRST_RESTART_DELAY_S = 1.0
"""Wait before the first restart of a service; doubled for each further one in the window."""
ROTATION_WAIT_S = 30.0
"""How long `kvmesh scale` waits for the router to route to a worker it added, once the worker
says it serves."""
ROTATION_POLL_S = 0.25
"""How often it asks the router meanwhile (the router checks its workers every 0.5 s)."""

COLORS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")

POOL_ROLES = {
    "prefill": "prefill",
    "decode": "decode",
    "worker": "colocated",
    "colocated": "colocated",
}
"""`kvmesh scale POOL` names -> worker roles."""

ROLE_PROTO = {
    "prefill": worker_pb2.WORKER_ROLE_PREFILL,
    "decode": worker_pb2.WORKER_ROLE_DECODE,
    "colocated": worker_pb2.WORKER_ROLE_COLOCATED,
}


def in_rotation(status: router_pb2.RouterStatusResponse, address: str) -> bool:
    """Whether the router's status shows the worker at `address` taking requests."""
    return any(w.healthy for pool in status.pools for w in pool.workers if w.address == address)


def start_waves(services: list[StackService]) -> list[list[StackService]]:
    """Cache and workers first (they depend on nothing), then the router, then the gateway."""
    later = ("router", "gateway")
    first = [s for s in services if s.name not in later]
    return [first, *([s for s in services if s.name == name] for name in later)]


def make_printer(console: Console) -> Printer:
    """A printer that prefixes each line with its service's name, in a stable colour."""
    colors: dict[str, str] = {}

    def printer(name: str, line: str) -> None:
        color = colors.setdefault(name, COLORS[len(colors) % len(COLORS)])
        console.print(Text.assemble((f"{name:>10} | ", color), line), soft_wrap=True)

    return printer


def summary(services: list[StackService]) -> Table:
    """The table printed once everything answers."""
    table = Table(title="kvmesh is up")
    for column in ("service", "module", "address", "metrics"):
        table.add_column(column)
    for service in services:
        name = f"{service.name} ({service.role})" if service.role else service.name
        address = service.address
        if service.openai_url is not None:
            address += f", OpenAI API {service.openai_url}"
        table.add_row(name, service.module, address, f"{service.host}:{service.metrics_port}")
    return table


@dataclass
class Stack:
    """A running stack: its options, its processes, and the scaling operations on them."""

    options: StackOptions
    supervisor: Supervisor
    console: Console
    services: list[StackService] = field(default_factory=list)

    @property
    def router(self) -> StackService:
        return next(s for s in self.services if s.name == "router")

    def workers(self, role: str) -> list[Child]:
        """Running workers of a role, oldest first."""
        return [c for c in self.supervisor.children if c.service.role == role]

    async def _router_call(self, method: str, request: Any) -> Any:
        async with member_channel(self.router.address, operator(self.options.state_dir)) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            return await getattr(stub, method)(request, timeout=10)

    async def add_worker(self, role: str) -> StackService:
        """Starts one more worker of `role` and announces it to the router."""
        used_slots = {s.port for s in self.services}
        slot = 0
        while worker_service(self.options, role, 0, slot).port in used_slots:
            slot += 1
        index = max(
            (int(s.name.rsplit("-", 1)[1]) + 1 for s in self.services if s.role == role), default=0
        )
        # The newcomer shares the cores with every worker already running.
        env = worker_env(self.options, sum(1 for s in self.services if s.role) + 1)
        service = worker_service(self.options, role, index, slot, env)
        self.supervisor.check_ports([service])
        if self.options.tls:
            issue_certificates(self.options, [service])
        child = await self.supervisor.spawn(service)
        await self.supervisor.wait_ready([child])
        self.services.append(service)
        reply: router_pb2.WorkerChangeResponse = await self._router_call(
            "AddWorker",
            router_pb2.AddWorkerRequest(
                tier=self.options.tier_name, role=ROLE_PROTO[role], address=service.address
            ),
        )
        await self._until_in_rotation(service.address, reply.status)
        return service

    async def _until_in_rotation(
        self, address: str, status: router_pb2.RouterStatusResponse
    ) -> None:
        """Returns once the router routes to `address`: its check at AddWorker can fail while
        a newcomer that has just said SERVING still settles in, and until the next check the
        router sends it nothing, though `kvmesh scale` would already have said it was added."""
        try:
            async with asyncio.timeout(ROTATION_WAIT_S):
                while not in_rotation(status, address):
                    await asyncio.sleep(ROTATION_POLL_S)
                    status = await self._router_call("Status", router_pb2.RouterStatusRequest())
        except TimeoutError:
            raise Unavailable(
                f"{address} started, but the router has not put it in rotation after "
                f"{ROTATION_WAIT_S:.0f}s (`kvmesh status` shows why)"
            ) from None

    async def drain_worker(self, role: str) -> StackService:
        """Takes the newest worker of `role` out of rotation, then lets it finish and exit."""
        running = self.workers(role)
        if len(running) <= 1:
            raise InvalidArgument("delta", f"the {role} pool keeps at least one worker")
        child = running[-1]
        await self._router_call(
            "RemoveWorker", router_pb2.RemoveWorkerRequest(address=child.service.address)
        )
        await self.supervisor.stop(child)
        self.services.remove(child.service)
        return child.service

    async def handle_control(self, request: dict[str, Any]) -> dict[str, Any]:
        """Serves one `kvmesh scale` request: {"op": "scale", "pool": ..., "delta": ...}."""
        if request.get("op") != "scale":
            raise InvalidArgument("op", f"unknown operation {request.get('op')!r}")
        pool = str(request.get("pool", ""))
        if pool not in POOL_ROLES:
            raise InvalidArgument("pool", f"must be one of {sorted(POOL_ROLES)}, got {pool!r}")
        delta = int(request.get("delta", 0))
        role = POOL_ROLES[pool]
        changed: list[str] = []
        for _ in range(abs(delta)):
            service = await (self.add_worker(role) if delta > 0 else self.drain_worker(role))
            verb = "added" if delta > 0 else "drained"
            self.console.print(f"[bold]{verb} {service.name} at {service.address}[/]")
            changed.append(service.address)
        return {"ok": True, "pool": pool, "changed": changed, "workers": len(self.workers(role))}


def issue_certificates(options: StackOptions, services: list[StackService]) -> None:
    """Certificates from the stack's CA (made on first use) for `services` and the operator,
    valid for the hosts they are reached on."""
    authority = StackAuthority.open(tls_folder(options.state_dir))
    hosts = sorted({options.host, "127.0.0.1", "localhost"} - {"0.0.0.0"})
    for service in services:
        authority.issue(service.name, certificate_subject(service), hosts)
    authority.issue("operator", certificate_name(MeshRole.OPERATOR, OPERATOR_MEMBER_NAME), hosts)


def operator(state_dir: Path, secret_file: Path | None = None) -> MeshMember | None:
    """The operator (`kvmesh up`, `kvmesh status`) of the stack kept in `state_dir`: its mesh
    secret (there, or `secret_file`) and, with --tls, its operator certificate; None for an
    open mesh."""
    secret_file = secret_file or mesh_secret_path(state_dir)
    tls = member_tls(state_dir, "operator")
    if not secret_file.exists() and tls is None:
        return None
    keys = MeshKeys.from_file(secret_file if secret_file.exists() else None)
    return MeshMember(MeshRole.OPERATOR, OPERATOR_MEMBER_NAME, keys, tls)


def try_command(gateway_address: str, options: StackOptions) -> str:
    """A first command that works as printed: the kvmesh beside this Python (no venv to
    activate) and, with tenants on, the key it needs."""
    kvmesh = Path(sys.executable).parent / "kvmesh"
    program = str(kvmesh) if kvmesh.exists() else f"{sys.executable} -m kvmesh.cli"
    command = f'{program} generate --target {gateway_address} "Hello"'
    if options.tls:
        command += f" --ca-file {tls_folder(options.state_dir) / CA_CERT}"
    if options.tenants:
        command += (
            f"   (with KVMESH_API_KEY set to the key of a tenant in {options.tenants}; "
            "`kvmesh tenants add` prints a new one)"
        )
    return command


async def why_not_start(options: StackOptions) -> str:
    """Why this stack cannot start, found before any process starts (empty: it can): a model
    that is not there would otherwise fail every worker, and a live stack's state would be
    overwritten."""
    try:
        resolve_model_path(options.model)
    except ModelLoadError as error:
        return str(error)
    if await control_answers(socket_path(options.state_dir)):
        return (
            f"a stack is already running from {options.state_dir}; stop it first, or start "
            "this one with --port-offset N"
        )
    return ""


def report_failure(reason: str) -> None:
    """One line on stderr, however narrow the terminal."""
    Console(stderr=True).print(f"[bold red]kvmesh up failed:[/] {reason}", soft_wrap=True)


async def run_up(options: StackOptions, trace_file: Path | None, console: Console) -> int:
    """Starts the stack, waits for Ctrl-C / SIGTERM or a crash, stops everything; exit code.

    `trace_file` must be absolute: every service appends its spans to it."""
    env = {TRACE_FILE_ENV: str(trace_file)} if trace_file else {}
    stack = Stack(options, Supervisor(printer=make_printer(console), env=env), console)
    stack.services = plan_stack(options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    refusal = await why_not_start(options)
    if refusal:
        report_failure(refusal)
        return 1
    try:
        stack.supervisor.check_ports(stack.services)
        write_pools_file(options, [s for s in stack.services if s.role])
        if options.mesh_auth:
            write_secret_file(mesh_secret_path(options.state_dir))
        if options.tls:
            issue_certificates(options, stack.services)
        starting = asyncio.create_task(stack.supervisor.start_all(start_waves(stack.services)))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            console.print("[yellow]interrupted while starting: stopping[/]")
            await stack.supervisor.stop_all()
            return 130
        starting.result()
    except StartupError as error:
        report_failure(str(error))
        await stack.supervisor.stop_all()
        return 1
    control = await serve_control(socket_path(options.state_dir), stack.handle_control)
    try:
        gateway = next(s for s in stack.services if s.name == "gateway")
        addresses = {"gateway": gateway.address, "router": stack.router.address}
        write_stack_file(options.state_dir, addresses)
        console.print(summary(stack.services))
        console.print(
            f"[bold green]gateway ready at {gateway.address}, OpenAI API at {gateway.openai_url}[/]"
        )
        console.print(f"try: {try_command(gateway.address, options)}", markup=False)
        return await wait_for_stop_or_crash(stack, stop)
    finally:  # whatever ends the wait: the stack stops and its state goes with it
        control.close()
        await stack.supervisor.stop_all()
        socket_path(options.state_dir).unlink(missing_ok=True)
        stack_file(options.state_dir).unlink(missing_ok=True)


class PipeSafeOutput(io.TextIOBase):
    """Standard output that goes quiet once its reader is gone, so that `kvmesh up | tee log`
    stopped with Ctrl-C (which ends tee first) still stops every service and removes its
    state instead of dying on BrokenPipeError."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._broken = False

    def write(self, text: str) -> int:
        if not self._broken:
            try:
                self._stream.write(text)
                self._stream.flush()
            except (BrokenPipeError, ValueError):  # ValueError: the stream was closed
                self._broken = True
                self._point_at_devnull()
        return len(text)

    def isatty(self) -> bool:
        return not self._broken and self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    def _point_at_devnull(self) -> None:
        """The interpreter flushes stdout at exit: give that flush somewhere to go."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        with contextlib.suppress(OSError, ValueError):
            os.dup2(devnull, self._stream.fileno())
        os.close(devnull)


async def wait_for_stop_or_crash(stack: Stack, stop: asyncio.Event) -> int:
    """0 after Ctrl-C / SIGTERM; 1 when a service keeps exiting by itself.

    A service that exits by itself (not a drained worker) is started again on its ports after
    a backoff (1, 2, 4 s), the router routing around it meanwhile; the stack stops only when
    one exits more than RESTARTS_ALLOWED times within RESTART_WINDOW_S."""
    stopped = asyncio.create_task(stop.wait())
    exits: dict[str, list[float]] = {}
    loop = asyncio.get_running_loop()
    while True:
        crashed = asyncio.create_task(stack.supervisor.first_exit())
        await asyncio.wait({crashed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if stopped.done():
            crashed.cancel()
            stack.console.print("[yellow]stopping kvmesh[/]")
            return 0
        child = crashed.result()
        if child not in stack.supervisor.children:
            continue
        name, code, now = child.service.name, child.process.returncode, loop.time()
        recent = [t for t in exits.get(name, []) if now - t < RESTART_WINDOW_S]
        exits[name] = [*recent, now]
        if len(recent) >= RESTARTS_ALLOWED:
            stack.console.print(
                f"[bold red]{name} exited unexpectedly (code {code}), {len(recent) + 1} times"
                f" within {RESTART_WINDOW_S:.0f}s; stopping the stack[/]"
            )
            return 1
        delay_s = FIRST_RESTART_DELAY_S * 2 ** len(recent)
        stack.console.print(
            f"[bold yellow]{name} exited unexpectedly (code {code}); restarting it in"
            f" {delay_s:.0f}s (restart {len(recent) + 1} of {RESTARTS_ALLOWED} allowed within"
            f" {RESTART_WINDOW_S:.0f}s); the router routes around it meanwhile[/]"
        )
        restart = asyncio.create_task(stack.supervisor.restart(child, delay_s))
        await asyncio.wait({restart, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if stopped.done():
            restart.cancel()
            with contextlib.suppress(asyncio.CancelledError, StartupError):
                await restart
            stack.console.print("[yellow]stopping kvmesh[/]")
            return 0
        try:
            restart.result()
        except StartupError as error:
            # The new process is a child that has exited: the next round counts it.
            stack.console.print(f"[bold red]{name} did not come back: {error}[/]")
            continue
        stack.console.print(f"[green]{name} restarted[/]")
