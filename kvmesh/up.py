"""`kvmesh up`: the whole mesh as local processes, ready for `kvmesh generate`."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvmesh.stack import StackOptions, StackService, plan_stack, write_pools_file
from kvmesh.supervisor import Printer, StartupError, Supervisor
from kvmesh.telemetry import TRACE_FILE_ENV

COLORS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")


def start_waves(services: list[StackService]) -> list[list[StackService]]:
    """Cache and workers first (they depend on nothing), then the router, then the gateway."""
    later = {"router", "gateway"}
    first = [s for s in services if s.name not in later]
    return [
        first,
        [s for s in services if s.name == "router"],
        [s for s in services if s.name == "gateway"],
    ]


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
    for column in ("service", "module", "gRPC", "metrics"):
        table.add_column(column)
    for service in services:
        name = f"{service.name} ({service.role})" if service.role else service.name
        table.add_row(
            name, service.module, service.address, f"{service.host}:{service.metrics_port}"
        )
    return table


async def run_up(options: StackOptions, trace_file: Path | None, console: Console) -> int:
    """Starts the stack, waits for Ctrl-C / SIGTERM or a crash, stops everything; exit code.

    `trace_file` must be absolute: every service appends its spans to it."""
    services = plan_stack(options)
    env = {TRACE_FILE_ENV: str(trace_file)} if trace_file else {}
    supervisor = Supervisor(printer=make_printer(console), env=env)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        supervisor.check_ports(services)
        write_pools_file(options, [s for s in services if s.role])
        starting = asyncio.create_task(supervisor.start_all(start_waves(services)))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            console.print("[yellow]interrupted while starting: stopping[/]")
            await supervisor.stop_all()
            return 130
        starting.result()
    except StartupError as error:
        console.print(f"[bold red]kvmesh up failed:[/] {error}")
        await supervisor.stop_all()
        return 1
    gateway = next(s for s in services if s.name == "gateway")
    console.print(summary(services))
    console.print(f"[bold green]gateway ready at {gateway.address}[/]")
    console.print(f'try: kvmesh generate --target {gateway.address} "Hello"', markup=False)
    crashed = asyncio.create_task(supervisor.first_exit())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({crashed, stopped}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if crashed.done():
        child = crashed.result()
        console.print(
            f"[bold red]{child.service.name} exited unexpectedly (code {child.process.returncode});"
            " stopping the stack[/]"
        )
        code = 1
    else:
        crashed.cancel()
        console.print("[yellow]stopping kvmesh[/]")
    await supervisor.stop_all()
    return code
