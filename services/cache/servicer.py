"""gRPC face of the response cache: protobuf in, ResponseCache, protobuf out."""

from __future__ import annotations

import grpc

from kvmesh.errors import InvalidArgument, Unavailable
from kvmesh.v1 import cache_pb2, cache_pb2_grpc
from services.cache.backends import BackendUnavailable
from services.cache.response_cache import ResponseCache


def _require_key(key: cache_pb2.CacheKey) -> None:
    if not key.model:
        raise InvalidArgument("key.model", "must name the model tier")
    if not key.prompt_token_ids:
        raise InvalidArgument("key.prompt_token_ids", "must not be empty")


class CacheServicer(cache_pb2_grpc.CacheServicer):
    """Implements kvmesh.v1.Cache."""

    def __init__(self, cache: ResponseCache) -> None:
        self.cache = cache

    async def Lookup(
        self, request: cache_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.LookupResponse:
        _require_key(request.key)
        found = await self.cache.lookup(request.key)
        return cache_pb2.LookupResponse(hit=found is not None, response=found)

    async def Store(
        self, request: cache_pb2.StoreRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.StoreResponse:
        _require_key(request.key)
        reason = await self.cache.store(request.key, request.response)
        return cache_pb2.StoreResponse(stored=reason is None, reason=reason or "")

    async def Invalidate(
        self, request: cache_pb2.InvalidateRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.InvalidateResponse:
        if request.WhichOneof("target") is None:
            raise InvalidArgument("target", "name a key, a model or all")
        try:
            removed = await self.cache.invalidate(request)
        except BackendUnavailable as error:
            raise Unavailable(f"cache backend unreachable: {error}") from error
        return cache_pb2.InvalidateResponse(removed=removed)

    async def Stats(
        self, request: cache_pb2.CacheStatsRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.CacheStatsResponse:
        counters = self.cache.counters
        try:
            held = await self.cache.backend.stats()
        except BackendUnavailable as error:
            raise Unavailable(f"cache backend unreachable: {error}") from error
        return cache_pb2.CacheStatsResponse(
            backend=self.cache.backend.name,
            hits=counters.hits,
            misses=counters.misses,
            stores=counters.stores,
            entries=held.entries,
            bytes=held.bytes,
            backend_errors=counters.backend_errors,
            evictions=held.evictions,
        )
