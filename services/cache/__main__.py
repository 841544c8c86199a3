"""`python -m services.cache`: the response cache service."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

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
from kvmesh.v1 import cache_pb2, cache_pb2_grpc
from services.cache.backends import CacheBackend, MemoryBackend, RedisBackend
from services.cache.config import CacheConfig
from services.cache.response_cache import ResponseCache
from services.cache.servicer import CacheServicer

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["Cache"].full_name


def build_server(config: CacheConfig) -> GrpcServer:
    """The cache service on its configured backend, not yet started."""
    backend: CacheBackend = (
        RedisBackend(config.redis, config.key_prefix, config.ttl_s)
        if config.redis
        else MemoryBackend(config.max_bytes)
    )
    logging.getLogger(__name__).info(
        "response cache backend: %s", f"redis {config.redis}" if config.redis else "memory"
    )
    cache = ResponseCache(backend, config.max_entry_bytes, config.redis_retry_s)
    binding = ServiceBinding(
        SERVICE_NAME, CacheServicer(cache), cache_pb2_grpc.add_CacheServicer_to_server
    )
    tls = tls_of(config)
    guard = mesh_guard(MeshKeys.from_file(config.mesh_secret_file), tls)
    return GrpcServer(config, "cache", [binding], on_stop=[backend.close], guard=guard, tls=tls)


def main(argv: Sequence[str] | None = None) -> None:
    """Parses the configuration and serves until SIGTERM."""
    config = load_config(CacheConfig, argv)
    configure_logging(config, "cache")
    asyncio.run(serve(build_server(config)))


if __name__ == "__main__":
    sys.exit(run_service_main("cache", lambda: main(sys.argv[1:])))
