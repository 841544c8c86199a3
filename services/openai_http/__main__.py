"""python -m services.openai_http: the OpenAI-compatible HTTP door of the gateway."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
from collections.abc import Sequence

import uvicorn
from prometheus_client import start_http_server

from kvmesh.config import load_config
from kvmesh.grpc_server import READY_PREFIX, configure_logging
from kvmesh.telemetry import setup_tracing
from services.openai_http.app import create_app
from services.openai_http.config import OpenAIHttpConfig
from services.openai_http.metrics import CountResponses

log = logging.getLogger("services.openai_http")

SERVICE = "openai_http"


def bind(config: OpenAIHttpConfig) -> socket.socket:
    """The listening socket, bound before uvicorn starts so port 0 is known for the ready line.

    Made with IPPROTO_TCP named: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    connections whose socket says so, and an accepted socket inherits the listener's protocol
    number; with 0 every small SSE write after the first waited for the client's delayed ACK
    (about 40 ms)."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def run(config: OpenAIHttpConfig) -> None:
    setup_tracing(SERVICE)
    sock = bind(config)
    port = sock.getsockname()[1]
    metrics_port = None
    if config.metrics_port >= 0:
        http, _ = start_http_server(config.metrics_port, addr=config.host)
        metrics_port = http.server_port
    server = uvicorn.Server(
        uvicorn.Config(
            CountResponses(create_app(config)),
            # "auto" is httptools (C, a dependency), which parses requests and frames chunked
            # bodies where h11 (pure Python, the fallback of an install that lacks it) would
            # take its share of every SSE chunk; asyncio's own loop, which grpc.aio runs on.
            http="auto",
            loop="asyncio",
            log_level=config.log_level.lower(),
            access_log=False,
            timeout_graceful_shutdown=int(config.grace_s) or 1,
            lifespan="on",
        )
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():  # noqa: ASYNC110 - uvicorn has a flag only
        await asyncio.sleep(0.01)
    if server.started:
        host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
        info = {
            "service": SERVICE,
            "address": f"{host}:{port}",
            "port": port,
            "metrics_port": metrics_port,
        }
        print(READY_PREFIX + json.dumps(info), flush=True)
        log.info("OpenAI API on http://%s:%d/v1, gateway %s", host, port, config.gateway)
    await serving


def main(argv: Sequence[str] | None = None) -> int:
    config = load_config(OpenAIHttpConfig, argv)
    configure_logging(config, SERVICE)
    try:
        asyncio.run(run(config))
    except OSError as error:
        log.error("cannot serve on %s:%d: %s", config.host, config.port, error)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
