"""The Gateway gRPC service: turns calls into Gateway methods and nothing more.

Requests whose bytes do not parse never reach it: the shared error interceptor
(kvmesh/grpc_server.py) answers them with INVALID_ARGUMENT, as on every service.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

import grpc

from kvmesh.background import Background
from kvmesh.errors import InvalidArgument
from kvmesh.serve_many import serve_many
from kvmesh.streams import CancelWatch, first_message
from kvmesh.tenants import Tenant
from kvmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.admission.gateway import Gateway

log = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Authenticates each call and delegates to the Gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._background = Background()

    async def Generate(
        self,
        request_iterator: AsyncIterator[gateway_pb2.GenerateClientMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        # The request is read before the credentials are checked: a client still writing it
        # when the call already ended would see a transport error instead of the real status.
        request = await _first_request(request_iterator)
        tenant = self._gateway.authenticate(context.invocation_metadata() or ())
        watch = CancelWatch(request_iterator, _cancel_reason)
        watch.start()
        try:
            answer = self._gateway.generate(
                tenant, request, watch.cancelled, context.time_remaining()
            )
            async with aclosing(answer) as events:
                async for event in events:
                    yield event
            await watch.caller_done()
        finally:
            await watch.close()

    async def GenerateMany(
        self,
        request_iterator: AsyncIterator[gateway_pb2.GenerateManyClientMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[common_pb2.GenerateManyEvents]:
        # As Generate: the first message is read before the credentials are checked. They
        # are the call's, so every request on it is the same tenant's.
        first = await first_message(request_iterator, "request")
        tenant = self._gateway.authenticate(context.invocation_metadata() or ())
        generation = functools.partial(self._many_generation, tenant)
        spawn = functools.partial(self._background.spawn, what="closing a GenerateMany stream")
        method = "/kvmesh.v1.Gateway/Generate"
        many = serve_many(first, request_iterator, context, method, generation, spawn)
        async for events in many:
            yield events

    def _many_generation(
        self,
        tenant: Tenant,
        message: gateway_pb2.GenerateManyClientMessage,
        cancelled: asyncio.Event,
        timeout_s: float | None,
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        """One request of a GenerateMany stream, as Generate runs it."""
        return self._gateway.generate(tenant, message.request, cancelled, timeout_s)

    async def Usage(
        self,
        request: gateway_pb2.UsageRequest,
        context: grpc.aio.ServicerContext,
    ) -> gateway_pb2.UsageResponse:
        tenant = self._gateway.authenticate(context.invocation_metadata() or ())
        return await self._gateway.usage(tenant, request.tenant)

    async def ListModels(
        self,
        request: gateway_pb2.ListModelsRequest,
        context: grpc.aio.ServicerContext,
    ) -> gateway_pb2.ListModelsResponse:
        self._gateway.authenticate(context.invocation_metadata() or ())
        return await self._gateway.list_models()


async def _first_request(
    messages: AsyncIterator[gateway_pb2.GenerateClientMessage],
) -> gateway_pb2.GenerateRequest:
    first = await first_message(messages, "request")
    if first.WhichOneof("message") != "request":
        raise InvalidArgument("request", "the first message must be a GenerateRequest")
    return first.request


def _cancel_reason(message: gateway_pb2.GenerateClientMessage) -> str | None:
    """The reason of a Cancel message; None for anything else (ignored after the request)."""
    if message.WhichOneof("message") != "cancel":
        return None
    return message.cancel.reason
