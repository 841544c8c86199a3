"""The Gateway gRPC service: turns calls into Gateway methods and nothing more."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvmesh.errors import InvalidArgument
from kvmesh.streams import CancelWatch, first_message
from kvmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.admission.gateway import Gateway

log = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


@dataclass(slots=True, frozen=True)
class MalformedMessage:
    """A request that protobuf could not parse (e.g. invalid UTF-8 in a string field)."""

    type_name: str
    error: str

    def invalid(self) -> InvalidArgument:
        return InvalidArgument("request", f"not a valid {self.type_name}: {self.error}")


def _lenient(parse: Callable[[bytes], Any], type_name: str) -> Callable[[bytes], Any]:
    """A deserializer that hands parse failures to the servicer instead of failing the call."""

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as error:
            return MalformedMessage(type_name, str(error))

    return deserialize


class _HandlerCapture:
    """Stands in for a server to collect the generated method handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        return None

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.handlers = handlers


def add_gateway_servicer(servicer: GatewayServicer, server: grpc.aio.Server) -> None:
    """Like the generated adder, but malformed requests reach the servicer as MalformedMessage
    (and end as INVALID_ARGUMENT) instead of failing inside gRPC."""
    capture = _HandlerCapture()
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, capture)
    input_types = {
        m.name: m.input_type.name
        for m in gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].methods
    }
    handlers = {
        name: handler._replace(  # type: ignore[attr-defined]
            request_deserializer=_lenient(handler.request_deserializer, input_types[name])
        )
        for name, handler in capture.handlers.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Authenticates each call and delegates to the Gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    async def Generate(
        self,
        request_iterator: AsyncIterator[gateway_pb2.GenerateClientMessage | MalformedMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        # The request is read before the credentials are checked: a client still writing it
        # when the call already ended would see a transport error instead of the real status.
        request = await _first_request(request_iterator)
        tenant = self._gateway.authenticate(context.invocation_metadata() or ())
        watch = CancelWatch(request_iterator, _cancel_reason)
        watch.start()
        try:
            async for event in self._gateway.generate(
                tenant, request, watch.cancelled, context.time_remaining()
            ):
                yield event
            await watch.caller_done()
        finally:
            await watch.close()

    async def Usage(
        self,
        request: gateway_pb2.UsageRequest | MalformedMessage,
        context: grpc.aio.ServicerContext,
    ) -> gateway_pb2.UsageResponse:
        tenant = self._gateway.authenticate(context.invocation_metadata() or ())
        if isinstance(request, MalformedMessage):
            raise request.invalid()
        return await self._gateway.usage(tenant, request.tenant)

    async def ListModels(
        self,
        request: gateway_pb2.ListModelsRequest | MalformedMessage,
        context: grpc.aio.ServicerContext,
    ) -> gateway_pb2.ListModelsResponse:
        self._gateway.authenticate(context.invocation_metadata() or ())
        if isinstance(request, MalformedMessage):
            raise request.invalid()
        return await self._gateway.list_models()


async def _first_request(
    messages: AsyncIterator[gateway_pb2.GenerateClientMessage | MalformedMessage],
) -> gateway_pb2.GenerateRequest:
    first = await first_message(messages, "request")
    if isinstance(first, MalformedMessage):
        raise first.invalid()
    if first.WhichOneof("message") != "request":
        raise InvalidArgument("request", "the first message must be a GenerateRequest")
    return first.request


def _cancel_reason(message: gateway_pb2.GenerateClientMessage | MalformedMessage) -> str | None:
    """The reason of a Cancel message; None for anything else (ignored after the request)."""
    if isinstance(message, MalformedMessage) or message.WhichOneof("message") != "cancel":
        return None
    return message.cancel.reason
