"""Server spans for every kvmesh RPC, continuing the caller's W3C trace.

OpenTelemetry's own grpc.aio server interceptor attaches the span's context around each
`yield` of a streaming handler and detaches it when the stream closes; a stream closed by a
cancelling client is finalised in another context, and every cancel logged "Failed to detach
context" with a traceback. Each RPC runs in its own asyncio task, so here the span's context
is attached once, at the start of the RPC, and dies with the task: nothing to detach.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from kvmesh.errors import KvmeshError

UNTRACED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")
"""Health probes and reflection belong to no request: no spans for them."""

_tracer = trace.get_tracer(__name__)


def _start_span(method: str, context: grpc.aio.ServicerContext) -> Span:
    carrier = {
        key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)
    }
    return _start_span_under(method, carrier)


def _start_span_under(method: str, carrier: dict[str, str]) -> Span:
    """A SERVER span for `method` whose parent is the trace context in `carrier` (W3C headers),
    attached to the current context (the task's: it dies with it, nothing to detach)."""
    parent = propagate.extract(carrier)
    service, _, name = method.lstrip("/").partition("/")
    span = _tracer.start_span(
        method,
        context=parent,
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
    )
    otel_context.attach(trace.set_span_in_context(span, parent))
    return span


def _end_span(span: Span, context: grpc.aio.ServicerContext, error: BaseException | None) -> None:
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode):
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            span.set_status(Status(StatusCode.ERROR, context.details() or code.name))
    elif error is not None and not isinstance(error, grpc.aio.AbortError):
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
    span.end()


def _traced_unary(behavior: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Any]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        span = _start_span(method, context)
        error: BaseException | None = None
        try:
            return await behavior(request, context)
        except BaseException as caught:
            error = caught
            raise
        finally:
            _end_span(span, context, error)

    return wrapper


@contextlib.contextmanager
def server_span(method: str, carrier: dict[str, str]) -> Iterator[Span]:
    """The span of one request that shares a call with others (a GenerateMany stream's
    generation: kvmesh/generate_many.py), named as its own call would be; run it in a task of
    its own.
    A KvmeshError that ends it sets the status its own call would have ended with."""
    span = _start_span_under(method, carrier)
    try:
        yield span
    except KvmeshError as error:
        span.set_attribute("rpc.grpc.status_code", grpc.StatusCode[error.status].value[0])
        span.set_status(Status(StatusCode.ERROR, error.message))
        raise
    except BaseException as error:
        if not isinstance(error, (GeneratorExit, asyncio.CancelledError)):
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        raise
    finally:
        span.end()


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every kvmesh handler in a SERVER span whose parent is the caller's span.

    It stands in front of kvmesh.grpc_server's error interceptor, whose handlers are all
    coroutines (a streaming one writes its servicer's responses itself), so one wrapper serves
    every kind of call."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(UNTRACED_PREFIXES):
            return handler
        codec = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _traced_unary(handler.unary_unary, method), **codec
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _traced_unary(handler.stream_unary, method), **codec
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _traced_unary(handler.unary_stream, method), **codec
            )
        return grpc.stream_stream_rpc_method_handler(
            _traced_unary(handler.stream_stream, method), **codec
        )
