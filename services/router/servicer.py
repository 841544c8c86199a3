"""gRPC face of the router: Generate (bidi), ListModels, Status, AddWorker, RemoveWorker.

Generate takes an InferenceRequest with the prompt already tokenized (the gateway tokenizes)
and streams Started (with the placement and its reason), TokenChunk*, Finished. GenerateMany
runs many such requests on one stream (the gateway's), each as Generate runs it. A failure
after the first token ends the stream with UNAVAILABLE whose message closes with the usage so
far (see orchestrator.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from kvmesh.background import Background
from kvmesh.contracts.constraints import checked_constraint
from kvmesh.errors import InvalidArgument
from kvmesh.request_limits import check_inference_request
from kvmesh.serve_many import serve_many
from kvmesh.streams import CancelWatch, Coalescer, first_message
from kvmesh.telemetry import in_span, tracer
from kvmesh.v1 import common_pb2, gateway_pb2, router_pb2, router_pb2_grpc, worker_pb2
from services.router.monitor import WorkerMonitor
from services.router.orchestrator import Orchestrator
from services.router.pools import PoolRegistry, Role, WorkerState
from services.router.tiers import usd_per_1k_tokens

_tracer = tracer(__name__)

_ROLE_ORDER = (Role.PREFILL, Role.DECODE, Role.COLOCATED)


def _check(request: common_pb2.InferenceRequest) -> None:
    """A caller may have skipped the gateway's checks."""
    check_inference_request(request)
    checked_constraint(request.sampling)


def _cancel_reason(message: router_pb2.RouteMessage) -> str | None:
    return message.cancel.reason if message.WhichOneof("message") == "cancel" else None


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Implements kvmesh.v1.Router."""

    def __init__(
        self,
        registry: PoolRegistry,
        orchestrator: Orchestrator,
        monitor: WorkerMonitor,
    ) -> None:
        self.registry = registry
        self.orchestrator = orchestrator
        self.monitor = monitor
        self._background = Background()

    async def Generate(
        self,
        request_iterator: AsyncIterator[router_pb2.RouteMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        first = await first_message(request_iterator, "request")
        if first.WhichOneof("message") != "request":
            raise InvalidArgument("request", "the first message must be the request")
        request = first.request
        _check(request)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        watch = CancelWatch(request_iterator, _cancel_reason, request.request_id)
        watch.start()
        # gRPC may drop a handler whose caller went away without resuming it: the end of the
        # RPC itself stops the downstream calls.
        live: set[Coalescer[common_pb2.GenerateEvent]] = set()
        context.add_done_callback(
            lambda _: self._background.spawn(_close_all(live), f"closing {request.request_id}")
        )
        generation = self._generation(request, deadline, watch.cancelled, live)
        try:
            async with contextlib.aclosing(generation) as events:
                async for event in events:
                    yield event
            await watch.caller_done()
        finally:
            await watch.close()

    async def GenerateMany(
        self,
        request_iterator: AsyncIterator[common_pb2.GenerateManyMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[common_pb2.GenerateManyEvents]:
        first = await first_message(request_iterator, "request")
        spawn = functools.partial(self._background.spawn, what="closing a GenerateMany stream")
        method = "/kvmesh.v1.Router/Generate"
        many = serve_many(first, request_iterator, context, method, self._many_generation, spawn)
        async for events in many:
            yield events

    async def _many_generation(
        self,
        message: common_pb2.GenerateManyMessage,
        cancelled: asyncio.Event,
        timeout_s: float | None,
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        """One generation of a GenerateMany stream, as Generate runs it."""
        _check(message.request)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        live: set[Coalescer[common_pb2.GenerateEvent]] = set()
        generation = self._generation(message.request, deadline, cancelled, live)
        async with contextlib.aclosing(generation) as events:
            async for event in events:
                yield event

    async def _generation(
        self,
        request: common_pb2.InferenceRequest,
        deadline: float | None,
        cancelled: asyncio.Event,
        live: set[Coalescer[common_pb2.GenerateEvent]],
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        """A checked request placed and run; its attempts (in `live`) are closed when it ends."""
        span = _tracer.start_span(
            "router.generate",
            attributes={
                "gen_ai.request.model": request.model,
                "kvmesh.request_id": request.request_id,
                "kvmesh.tenant": request.tenant,
            },
        )
        run = self.orchestrator.run(request, deadline, cancelled, live)
        try:
            async with contextlib.aclosing(in_span(span, run)) as events:
                async for event in events:
                    yield event
        finally:
            await _close_all(live)

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        models = []
        for tier in self.registry.tiers:
            stats = self.registry.stats_of(tier.name)
            tokens_per_second = self.registry.tokens_per_second(tier.name)
            models.append(
                gateway_pb2.ModelInfo(
                    id=tier.name,
                    base_model=tier.base_model,
                    quantization=tier.quantization,
                    fingerprint=self.registry.fingerprint(tier.name) or "",
                    usd_per_gpu_hour=tier.usd_per_gpu_hour,
                    tokens_per_second=tokens_per_second,
                    usd_per_1k_tokens=usd_per_1k_tokens(tier.usd_per_gpu_hour, tokens_per_second),
                    context_length=stats.context_length if stats is not None else 0,
                    available=self.registry.serves(tier.name),
                    fallback=tier.fallback,
                    service_rates=self._service_rates(tier.name),
                )
            )
        return gateway_pb2.ListModelsResponse(models=models)

    def _service_rates(self, tier: str) -> gateway_pb2.ServiceRates | None:
        """The tier's measured speed, averaged over its workers in rotation."""

        def addresses(*roles: Role) -> list[str]:
            return [w.address for role in roles for w in self.registry.in_rotation(tier, role)]

        rates = self.orchestrator.rates.tier_rates(
            addresses(Role.PREFILL, Role.COLOCATED), addresses(Role.DECODE, Role.COLOCATED)
        )
        return rates.to_proto() if rates is not None else None

    async def Status(
        self, request: router_pb2.RouterStatusRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouterStatusResponse:
        return self._status()

    async def AddWorker(
        self, request: router_pb2.AddWorkerRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.WorkerChangeResponse:
        self.registry.add(request.tier, Role.from_proto(request.role), request.address)
        # Checked at once, so the reply shows whether it is already in rotation.
        await self.monitor.check(request.address)
        return router_pb2.WorkerChangeResponse(status=self._status())

    async def RemoveWorker(
        self, request: router_pb2.RemoveWorkerRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.WorkerChangeResponse:
        self.registry.remove(request.address)
        return router_pb2.WorkerChangeResponse(status=self._status())

    def _status(self) -> router_pb2.RouterStatusResponse:
        pools = []
        for tier in self.registry.tiers:
            for role in _ROLE_ORDER:
                workers = self.registry.workers(tier.name, role)
                if not workers:
                    continue
                pools.append(
                    router_pb2.PoolStatus(
                        tier=tier.name,
                        role=role.proto,
                        workers=[_worker_status(w) for w in workers],
                        recommended_replicas=self.monitor.recommended(tier.name, role),
                    )
                )
        return router_pb2.RouterStatusResponse(pools=pools)


async def _close_all(live: set[Coalescer[common_pb2.GenerateEvent]]) -> None:
    """Closes a request's attempts (idempotent: a closed attempt closes again as a no-op)."""
    for events in list(live):
        await events.aclose()
        live.discard(events)


def _worker_status(worker: WorkerState) -> router_pb2.WorkerStatus:
    status = router_pb2.WorkerStatus(address=worker.address, healthy=worker.in_rotation)
    if worker.stats is not None:
        stats = worker_pb2.WorkerStats()
        stats.CopyFrom(worker.stats)
        del stats.cached_block_hashes[:]  # the count stays; the hashes are placement detail
        status.stats.CopyFrom(stats)
    return status
