"""The control socket of a running `kvmesh up`: `kvmesh scale` talks to it.

One JSON object per line in each direction over a Unix socket in the stack's state folder.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvmesh.errors import KvmeshError, Unavailable

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


STATE_ROOT = Path(".kvmesh")
"""Where `kvmesh up` keeps each stack's state folder, under the folder it was started in."""


def default_state_dir(gateway_port: int) -> Path:
    """A stack's own state folder, keyed by its gateway port: two stacks never share one."""
    return STATE_ROOT / f"stack-{gateway_port}"


def socket_path(state_dir: Path) -> Path:
    """Where a stack started from `state_dir` listens."""
    return state_dir / "control.sock"


def stack_file(state_dir: Path) -> Path:
    """The running stack's addresses, for `kvmesh status` and `kvmesh scale`."""
    return state_dir / "stack.json"


def write_stack_file(state_dir: Path, addresses: dict[str, str]) -> None:
    """Records a started stack's addresses (removed again when it stops)."""
    stack_file(state_dir).write_text(json.dumps(addresses, indent=2) + "\n", encoding="utf-8")


def read_stack_file(state_dir: Path) -> dict[str, str] | None:
    """The addresses a running stack recorded, or None when no stack runs from there."""
    try:
        addresses: dict[str, str] = json.loads(stack_file(state_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return addresses


async def control_answers(path: Path) -> bool:
    """Whether a live stack listens on the control socket `path` (a stale file does not)."""
    try:
        _, writer = await asyncio.open_unix_connection(str(path))
    except OSError:
        return False
    writer.close()
    return True


async def serve_control(path: Path, handler: Handler) -> asyncio.Server:
    """Answers each request line with the handler's reply (or its error)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(await reader.readline())
            reply = await handler(request)
        except (KvmeshError, ValueError, KeyError) as error:
            reply = {"ok": False, "error": str(error)}
        writer.write((json.dumps(reply) + "\n").encode())
        await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(on_connect, path=str(path))


async def call_control(path: Path, request: dict[str, Any]) -> dict[str, Any]:
    """Sends one request to a running stack and returns its reply."""
    try:
        reader, writer = await asyncio.open_unix_connection(str(path))
    except OSError as error:
        raise Unavailable(f"no running `kvmesh up` answers at {path}: {error}") from error
    writer.write((json.dumps(request) + "\n").encode())
    await writer.drain()
    reply: dict[str, Any] = json.loads(await reader.readline())
    writer.close()
    return reply
