"""The gateway's calls to the router and the response cache.

Router errors come back as typed kvmesh errors. The response cache fails open: any error or
timeout is a miss (or a store that did not happen), logged and counted, never a failed request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from kvmesh.client_streams import open_stream
from kvmesh.rpc_status import error_from_rpc
from kvmesh.service_rates import ServiceRates
from kvmesh.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    gateway_pb2,
    router_pb2,
    router_pb2_grpc,
)
from services.admission import metrics
from services.admission.catalog import ModelSpec

log = logging.getLogger(__name__)


class RouterClient:
    """Router.Generate and Router.ListModels over one channel."""

    def __init__(self, channel: grpc.aio.Channel, cancel_grace_s: float = 2.0) -> None:
        self._stub = router_pb2_grpc.RouterStub(channel)
        self._cancel_grace_s = cancel_grace_s

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
        """Starts Router.Generate; read its events with `events()`, close it with `close()`."""
        return RouterStream(self._stub, request, timeout_s, self._cancel_grace_s)


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
    """One Router.Generate call: the request goes first, a Cancel may follow."""

    def __init__(
        self,
        stub: router_pb2_grpc.RouterStub,
        request: common_pb2.InferenceRequest,
        timeout_s: float | None,
        cancel_grace_s: float,
    ) -> None:
        self._outbox: asyncio.Queue[router_pb2.RouteMessage | None] = asyncio.Queue()
        self._outbox.put_nowait(router_pb2.RouteMessage(request=request))
        self._call = open_stream(
            lambda requests: stub.Generate(requests, timeout=timeout_s), self._messages()
        )
        self._cancel_grace_s = cancel_grace_s
        self._cut_timer: asyncio.TimerHandle | None = None
        self._cut = False
        self._finished = False
        """The router's Finished arrived: the answer is whole, a cancel is too late."""

    async def _messages(self) -> AsyncIterator[router_pb2.RouteMessage]:
        # Stays open after the request (closing our side would not mean "cancel" to the
        # router) until close() puts None: gRPC's task reading it must end with the call.
        while (message := await self._outbox.get()) is not None:
            yield message

    async def events(self) -> AsyncIterator[common_pb2.GenerateEvent]:
        """The router's events; ends early (without Finished) when the call was cut."""
        try:
            async for event in self._call:
                if event.HasField("finished"):
                    self._finished = True
                    self._outbox.put_nowait(None)  # half-closes: the router ends the call now
                yield event
        except grpc.aio.AioRpcError as error:
            if self._finished or (self._cut and error.code() == grpc.StatusCode.CANCELLED):
                # After Finished nothing is missing (a Cancel written as the router ended the
                # call can fail the call's last step with INTERNAL: it is already done).
                return
            raise error_from_rpc(error) from None
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError on a read after a local cancel; only a cut we
            # made ourselves ends the stream quietly, a cancel of our own task propagates.
            task = asyncio.current_task()
            if self._cut and task is not None and not task.cancelling():
                return
            raise

    def cancel(self, reason: str) -> None:
        """Asks the router to abort; cuts the call if it has not ended after the grace time."""
        if self._finished or self._cut_timer is not None or self._call.done():
            return
        self._outbox.put_nowait(router_pb2.RouteMessage(cancel=common_pb2.Cancel(reason=reason)))
        self._cut_timer = asyncio.get_running_loop().call_later(self._cancel_grace_s, self.cut)

    def cut(self) -> None:
        """Cancels the call now (the router sees the cancellation and aborts downstream)."""
        if not self._call.done():
            self._cut = True
            self._call.cancel()

    def close(self) -> None:
        """Releases the call; a call still running is cut."""
        if self._cut_timer is not None:
            self._cut_timer.cancel()
        self.cut()
        self._outbox.put_nowait(None)


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
