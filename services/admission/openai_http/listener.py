"""The door's HTTP listener: uvicorn serving the app on the gateway's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections.abc import Iterator

import uvicorn

from kvmesh.grpc_server import port_in_use_message
from services.admission.openai_http.app import Door, create_app
from services.admission.openai_http.metrics import CountResponses


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before uvicorn starts so port 0 is known for the ready line.

    Made with IPPROTO_TCP named: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    connections whose socket says so, and an accepted socket inherits the listener's protocol
    number; with 0 every small SSE write after the first waited for the client's delayed ACK
    (about 40 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if error.errno != errno.EADDRINUSE:
            raise
        raise OSError(port_in_use_message(host, port, "--http-port")) from None
    sock.listen(2048)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: the gateway's own handle SIGTERM and
    SIGINT, and stop this listener after its gRPC server (HttpListener.stop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpListener:
    """The OpenAI door on `host:port`, in the running event loop, until stop()."""

    def __init__(self, door: Door, host: str, port: int, grace_s: float, log_level: str) -> None:
        self._socket = bind(host, port)
        self.port: int = self._socket.getsockname()[1]
        self._server = _Server(
            uvicorn.Config(
                CountResponses(create_app(door)),
                # "auto" is httptools (C, a dependency), which parses requests and frames
                # chunked bodies where h11 (pure Python, the fallback of an install that lacks
                # it) would take its share of every SSE chunk; asyncio's own loop, grpc.aio's.
                http="auto",
                loop="asyncio",
                log_level=log_level.lower(),
                access_log=False,
                timeout_graceful_shutdown=int(grace_s) or 1,
                lifespan="off",
            )
        )
        self._serving: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Serves from now on; raises what stopped uvicorn from starting."""
        self._serving = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started and not self._serving.done():  # noqa: ASYNC110 - uvicorn has a flag only
            await asyncio.sleep(0.01)
        if self._serving.done():
            self._serving.result()
            raise OSError(f"the HTTP door did not start on port {self.port}")

    async def stop(self) -> None:
        """Stops accepting, lets the requests in flight finish (within the grace), then ends."""
        if self._serving is None:
            return
        self._server.should_exit = True
        await self._serving
        self._socket.close()
