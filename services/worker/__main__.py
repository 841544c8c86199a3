"""`python -m services.worker --role prefill|decode|colocated --model ... --port ...`: a worker."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.config import load_config
from kvmesh.grpc_server import (
    GrpcServer,
    ServiceBinding,
    configure_logging,
    run_service_main,
    serve,
)
from kvmesh.mesh_auth import mesh_guard
from kvmesh.mesh_keys import MeshKeys
from kvmesh.tls import tls_of
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.worker.backends import create_engine
from services.worker.config import WorkerConfig
from services.worker.engine.api import EngineBackend
from services.worker.leases import LeaseSweeper, LeaseTable
from services.worker.servicer import WorkerServicer

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name

log = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL_S = 0.0005
"""How long a thread holding the GIL keeps it while another waits for it (Python's default is
5 ms). The engine steps in its own thread beside the event loop's (AsyncEngine): whenever a
kernel call returned while the loop's thread was writing streams, the step waited for the GIL,
up to the whole interval, before it could go on. The 32-concurrent serving row of `bench.peers`
(kvmesh alone, runs alternated, 2 cores of an AMD EPYC Zen 4) read 207.2-216.3 tok/s in five
runs at 0.5 ms (mean 211.8) and 201.6-207.1 in four at the default (mean 204.7)."""


@dataclass(slots=True)
class Worker:
    """A worker's parts, wired: engine, lease table and sweeper, servicer, gRPC server."""

    engine: EngineBackend
    servicer: WorkerServicer
    sweeper: LeaseSweeper
    server: GrpcServer

    async def start_background(self) -> None:
        """Starts the engine thread and the lease sweeper (the server is started apart)."""
        await self.engine.start()
        self.sweeper.start()

    async def start(self) -> None:
        """Starts everything, the server included (in-process use)."""
        await self.start_background()
        await self.server.start()

    async def stop(self) -> None:
        """Stops serving; the server's stop hook then ends the sweeper, leases and engine."""
        await self.server.stop(0)


def own_address(advertise_address: str) -> str:
    """The configured address with a missing host (":50061") filled with this machine's own
    address (a container's IP on its network), resolved once at start."""
    host, _, port = advertise_address.rpartition(":")
    if not advertise_address or host:
        return advertise_address
    return f"{socket.gethostbyname(socket.gethostname())}:{port}"


def build_worker(config: WorkerConfig, engine: EngineBackend | None = None) -> Worker:
    """A worker around `engine` (loaded from the config when None), not yet started."""
    config.validate()
    engine = engine or create_engine(
        config.engine,
        config.engine_config,
        kv_wire_format=config.kv_wire_format,
        vllm_eager=config.vllm_eager,
    )
    leases = LeaseTable(ttl_s=config.lease_ttl_s)
    keys = MeshKeys.from_file(config.mesh_secret_file)
    tls = tls_of(config)
    # The lease names this worker's address, known only once the server has bound its port.
    servers: list[GrpcServer] = []
    advertised = own_address(config.advertise_address)
    servicer = WorkerServicer(
        engine,
        config,
        leases,
        lambda: advertised or servers[0].address,
        keys,
        tls,
    )
    sweeper = LeaseSweeper(
        leases,
        servicer.exporter.expire,
        config.lease_sweep_interval_s,
        servicer.refresh_gauges,
    )

    async def close() -> None:
        await sweeper.stop()
        await servicer.close()
        await engine.shutdown()

    binding = ServiceBinding(SERVICE_NAME, servicer, worker_pb2_grpc.add_WorkerServicer_to_server)
    servers.append(
        GrpcServer(
            config, "worker", [binding], on_stop=[close], guard=mesh_guard(keys, tls), tls=tls
        )
    )
    return Worker(engine, servicer, sweeper, servers[0])


async def _run(config: WorkerConfig) -> None:
    worker = build_worker(config)
    log.info(
        "worker role=%s model=%s fingerprint=%s layout=%s",
        config.role,
        worker.engine.model_name,
        worker.engine.fingerprint,
        worker.engine.layout,
    )
    await worker.start_background()
    await serve(worker.server)


def main(argv: Sequence[str] | None = None) -> None:
    """Parses the configuration, loads the model and serves until SIGTERM."""
    config = load_config(WorkerConfig, argv)
    configure_logging(config, f"worker[{config.role}]")
    config.validate()
    os.nice(config.nice)  # before the engine starts: its processes inherit it
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    asyncio.run(_run(config))


if __name__ == "__main__":
    sys.exit(run_service_main("worker", lambda: main(sys.argv[1:])))
