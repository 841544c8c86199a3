"""python -m services.admission: the admission gateway."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence

from kvmesh.config import load_config
from kvmesh.grpc_server import (
    GrpcServer,
    ServiceBinding,
    configure_logging,
    run_service_main,
    serve,
)
from kvmesh.tls import tls_of
from kvmesh.v1 import gateway_pb2_grpc
from services.admission.config import AdmissionConfig
from services.admission.gateway import REQUEST_LOG, Gateway
from services.admission.openai_http.app import Door
from services.admission.openai_http.listener import HttpListener
from services.admission.servicer import SERVICE_NAME, GatewayServicer
from services.admission.wiring import build_gateway

log = logging.getLogger("services.admission")

_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def local_only(config: AdmissionConfig) -> AdmissionConfig:
    """Without a tenants file anyone could call: bind loopback only, and say so."""
    if config.tenants is not None:
        return config
    if config.host not in _LOOPBACK:
        log.warning("no tenants file: ignoring --host %s, binding 127.0.0.1 only", config.host)
        config = dataclasses.replace(config, host="127.0.0.1")
    log.warning(
        "no tenants file (--tenants): serving one unlimited local tenant without "
        "authentication, on %s only",
        config.host,
    )
    return config


def http_door(
    config: AdmissionConfig, gateway: Gateway, serving: Callable[[], bool]
) -> HttpListener | None:
    """The OpenAI door, a second listener on the same Gateway (None with --http-port -1): an
    HTTP request is admitted by a call in this process, not a gRPC call to the gateway
    (docs/openai_http.md, "Why a listener of the gateway")."""
    if config.http_port < 0:
        return None
    door = Door(gateway, serving, config.http_max_prompts)
    return HttpListener(door, config.host, config.http_port, config.grace_s, config.log_level)


async def run(config: AdmissionConfig) -> None:
    assembly = build_gateway(config)
    http = http_door(config, assembly.gateway, lambda: server.serving)
    server = GrpcServer(
        config,
        "admission",
        [
            ServiceBinding(
                SERVICE_NAME,
                GatewayServicer(assembly.gateway),
                gateway_pb2_grpc.add_GatewayServicer_to_server,
            )
        ],
        # The door stops once the gRPC server has drained, before the hooks that close what
        # the gateway's requests use.
        on_stop=[*([http.stop] if http else []), *assembly.on_stop],
        tls=tls_of(config),  # its clients verify it with the CA; they show no certificate
        ready_extras={"http_port": http.port} if http else {},
    )
    if http is not None:
        await http.start()
    warm = asyncio.ensure_future(assembly.gateway.catalog.warm_up())
    await serve(server)
    warm.cancel()


def main(argv: Sequence[str] | None = None) -> None:
    config = load_config(AdmissionConfig, argv)
    configure_logging(config, "admission")
    logging.getLogger(REQUEST_LOG).setLevel(
        logging.INFO if config.log_requests else logging.WARNING
    )
    asyncio.run(run(local_only(config)))


if __name__ == "__main__":
    sys.exit(run_service_main("admission", lambda: main(sys.argv[1:])))
