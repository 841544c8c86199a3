"""The gateway's calls to the router and the response cache.

Router errors come back as typed kvmesh errors; the gateway's requests share one
Router.GenerateMany call (kvmesh/generate_many.py). The response cache fails open: any error or
timeout is a miss (or a store that did not happen), logged and counted, never a failed request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

import grpc

from kvmesh.generate_many import GenerateManyCall, Generation
from kvmesh.rpc_status import error_from_rpc
from kvmesh.service_rates import ServiceRates
from kvmesh.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    gateway_pb2,
    router_pb2_grpc,
)
from services.admission import metrics
from services.admission.catalog import ModelSpec

log = logging.getLogger(__name__)


class RouterClient:
    """Router.GenerateMany and Router.ListModels over one untraced channel: the gateway's
    requests share one GenerateMany call, and each carries its own trace context."""

    def __init__(self, channel: grpc.aio.Channel, cancel_grace_s: float = 2.0) -> None:
        self._stub = router_pb2_grpc.RouterStub(channel)
        self._cancel_grace_s = cancel_grace_s
        self._call: GenerateManyCall[common_pb2.GenerateManyMessage] | None = None

    async def list_models(self, timeout_s: float = 5.0) -> list[ModelSpec]:
        try:
            response = await self._stub.ListModels(
                gateway_pb2.ListModelsRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from None
        return [_model_spec(info) for info in response.models]

    def generate(
        self, request: common_pb2.InferenceRequest, timeout_s: float | None
    ) -> RouterStream:
        """Starts the request on the router; read its events with `events()`, close it with
        `close()`."""
        if self._call is None or not self._call.takes_more:
            many = common_pb2.GenerateManyMessage
            self._call = GenerateManyCall(self._stub.GenerateMany, many, "the router")
        opening = common_pb2.GenerateManyMessage(request=request)
        generation = self._call.generate(opening, timeout_s)
        return RouterStream(generation, self._cancel_grace_s)


def _model_spec(info: gateway_pb2.ModelInfo) -> ModelSpec:
    return ModelSpec(
        id=info.id,
        base_model=info.base_model,
        quantization=info.quantization or "none",
        fingerprint=info.fingerprint,
        context_length=info.context_length,
        usd_per_gpu_hour=info.usd_per_gpu_hour,
        tokens_per_second=info.tokens_per_second,
        available=info.available,
        fallback=info.fallback,
        service_rates=(
            ServiceRates.from_proto(info.service_rates) if info.HasField("service_rates") else None
        ),
    )


class RouterStream:
    """One request on the router: its events, a Cancel that may follow, and a cut when the
    router has not ended it a grace time after the Cancel."""

    def __init__(self, generation: Generation, cancel_grace_s: float) -> None:
        self._generation = generation
        self._cancel_grace_s = cancel_grace_s
        self._cut_timer: asyncio.TimerHandle | None = None

    def events(self) -> AsyncGenerator[common_pb2.GenerateEvent]:
        """The router's events; ends early (without Finished) when the request was cut."""
        return self._generation.events()

    def cancel(self, reason: str) -> None:
        """Asks the router to abort; cuts the request if it has not ended after the grace
        time."""
        if self._generation.ended or self._cut_timer is not None:
            return
        self._generation.cancel(reason)
        self._cut_timer = asyncio.get_running_loop().call_later(
            self._cancel_grace_s, self._generation.cut
        )

    def close(self) -> None:
        """Releases the request; one still running is cancelled."""
        if self._cut_timer is not None:
            self._cut_timer.cancel()
        self._generation.close("the gateway closed the request")


class CacheClient:
    """Response-cache Lookup / Store that fail open."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float) -> None:
        self._stub = cache_pb2_grpc.CacheStub(channel)
        self._timeout_s = timeout_s

    async def lookup(self, key: cache_pb2.CacheKey) -> cache_pb2.CachedResponse | None:
        """The stored answer, or None on a miss or any cache failure."""
        try:
            response = await self._stub.Lookup(
                cache_pb2.LookupRequest(key=key), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as error:
            self._failed("lookup", error)
            metrics.RESPONSE_CACHE_LOOKUPS.labels("error").inc()
            return None
        metrics.RESPONSE_CACHE_LOOKUPS.labels("hit" if response.hit else "miss").inc()
        return response.response if response.hit else None

    async def store(self, key: cache_pb2.CacheKey, response: cache_pb2.CachedResponse) -> bool:
        """Stores an answer; False when the cache refused it or failed."""
        try:
            result = await self._stub.Store(
                cache_pb2.StoreRequest(key=key, response=response), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as error:
            self._failed("store", error)
            return False
        if not result.stored:
            log.debug("response cache did not store: %s", result.reason)
        return result.stored

    @staticmethod
    def _failed(operation: str, error: grpc.aio.AioRpcError) -> None:
        metrics.BACKEND_ERRORS.labels("response_cache").inc()
        log.warning(
            "response cache %s failed (%s: %s): treated as a miss",
            operation,
            error.code().name,
            error.details(),
        )
