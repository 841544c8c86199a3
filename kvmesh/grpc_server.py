"""The one way every kvmesh service serves gRPC.

`GrpcServer` wires a grpc.aio server with: the standard health service, server reflection
(grpcurl works), the OpenTelemetry server interceptor, one interceptor that checks the
caller's mesh membership (internal services, see mesh_auth.py) and maps kvmesh's exceptions to
gRPC statuses, and a Prometheus metrics endpoint. `serve()` runs it
until SIGTERM/SIGINT, then flips health to NOT_SERVING, waits `shutdown_delay_s` so load
balancers see it, and stops with the configured grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import gc
import inspect
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc._cython import cygrpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter, start_http_server

from kvmesh.channels import MAX_MESSAGE_BYTES, SERVER_KEEPALIVE_OPTIONS
from kvmesh.config import ServerConfig
from kvmesh.errors import Internal, InvalidArgument, KvmeshError, Unimplemented
from kvmesh.mesh_auth import MeshGuard
from kvmesh.reflection import enable_reflection
from kvmesh.rpc_status import abort_with_error
from kvmesh.server_tracing import TracingInterceptor
from kvmesh.supervised import SupervisorGone, die_with_supervisor
from kvmesh.telemetry import setup_tracing
from kvmesh.tls import TlsFiles

log = logging.getLogger(__name__)

READY_PREFIX = "KVMESH_READY "
"""Start of the line a service prints once it serves: the prefix, then a JSON object."""

RPC_ERRORS = Counter(
    "kvmesh_rpc_errors_total",
    "RPCs that ended with an error status, by service, method and code.",
    ["service", "method", "code"],
)

StopHook = Callable[[], Awaitable[None]]


@dataclass(slots=True)
class ServiceBinding:
    """One gRPC service to host: its full proto name, its servicer and the generated adder."""

    name: str
    """Full service name, e.g. "kvmesh.v1.Cache" (for health and reflection)."""
    servicer: object
    """The servicer instance."""
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    """The generated `add_XServicer_to_server` function."""


GRPC_AIO_LOGGER = "grpc._cython.cygrpc"
"""The logger of grpc.aio's server loop."""
_ENDED_IN_CORE = 'Failed "execute_batch"'
"""How an ExecuteBatchError starts when gRPC's core failed the batch because the call had
ended (a batch core refused to start, a misuse, says "Failed grpc_call_start_batch")."""


class EndedCallFilter(logging.Filter):
    """One DEBUG line, not an ERROR with a traceback, for an answer to a call that had ended.

    When a call's deadline passes (or its caller goes away) while its handler is sending (a
    message, the response, the status of an error such as the DEADLINE_EXCEEDED of a
    downstream call with the same deadline), gRPC's core fails that send. grpc.aio ignores
    the failure once its own task has seen the call end, but logs it at ERROR when the failed
    send is handled first: an ordinary deadline, logged as a bug once in a few hundred. Any
    other record passes as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _call_ended_under(record.exc_info[1] if record.exc_info else None):
            log.debug("%s: the call had ended (deadline or cancel) before it", record.getMessage())
            return False
        return True


ENDED_CALL_FILTER = EndedCallFilter()


def _call_ended_under(error: BaseException | None) -> bool:
    """Whether `error` is gRPC's core failing a send because the call had already ended."""
    return isinstance(error, cygrpc.ExecuteBatchError) and str(error).startswith(_ENDED_IN_CORE)


def _method_labels(method: str) -> tuple[str, str]:
    service, _, name = method.lstrip("/").partition("/")
    return service, name


class _Undecodable:
    """Stands in for a request whose bytes did not parse, so the servicer never sees it."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """Wraps a request deserializer so corrupt bytes become INVALID_ARGUMENT, not UNKNOWN."""
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as error:  # noqa: BLE001 - any parse failure is the caller's fault
            return _Undecodable(f"{type(error).__name__}: {error}")

    return parse


def _checked(request: Any) -> Any:
    if isinstance(request, _Undecodable):
        raise InvalidArgument("request", f"could not be decoded ({request.reason})")
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _checked(request)


def _requests(request_or_iterator: Any, streaming: bool) -> Any:
    return _checked_stream(request_or_iterator) if streaming else _checked(request_or_iterator)


SERVER_DRAINING: contextvars.ContextVar[asyncio.Event] = contextvars.ContextVar("server_draining")
"""Set in each call's handler to its server's drain (grpc takes no new calls from then), so
that a call kept open between requests (a GenerateMany call: kvmesh/serve_many.py) can tell
its caller, who then half-closes it instead of holding the drain for its grace."""


def _wrap_unary(
    behavior: Callable[..., Awaitable[Any]],
    method: str,
    streaming: bool,
    guard: MeshGuard | None,
    draining: asyncio.Event,
) -> Callable[..., Any]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        SERVER_DRAINING.set(draining)  # the call's own task: its context is the call's alone
        try:
            if guard is not None:
                await _admitted(guard, method, context, request if streaming else None)
            return await behavior(_requests(request, streaming), context)
        except KvmeshError as error:
            await _report(context, error, method)
        except Exception as error:  # any bug must still end the RPC cleanly
            if _call_ended_under(error):
                # A write failed because the caller had gone: grpc ends such a call without a
                # status (EndedCallFilter quiets its log line). Returning instead would have it
                # send the status, and after a failed first write that batch repeats the
                # initial metadata, which core refuses (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS).
                raise
            await _report(context, _internal(error, method), method)

    return wrapper


REFUSED_STREAM_READ_S = 1.0
"""How long a refused call with a request stream waits for the caller's first message."""


async def _admitted(
    guard: MeshGuard, method: str, context: grpc.aio.ServicerContext, requests: Any
) -> None:
    """The guard's check; a refused caller's request stream (requests) has its first message
    read, or REFUSED_STREAM_READ_S waited for, before the refusal. A refusal that ends the
    call while the client's first write is on its way makes the client's grpc end the call
    as INTERNAL, hiding the refusal (and a later write raises InvalidStateError)."""
    try:
        guard.check(method, context)
    except KvmeshError:
        if requests is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(anext(aiter(requests), None), REFUSED_STREAM_READ_S)
        raise


def _wrap_stream(
    behavior: Callable[..., Any],
    method: str,
    streaming: bool,
    guard: MeshGuard | None,
    draining: asyncio.Event,
) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(behavior):
        # A servicer that writes with context.write (grpc's own health Watch) returns a coroutine.
        return _wrap_unary(behavior, method, streaming, guard, draining)
    return _wrap_unary(_written(behavior), method, streaming, guard, draining)


def _written(behavior: Callable[..., AsyncGenerator[Any]]) -> Callable[..., Awaitable[None]]:
    """A generator servicer as one that writes its responses itself, instead of yielding them
    to grpc: grpc abandons a response generator whose call is cancelled, and its finally blocks
    then run only when the collector finalizes it, on a task nobody holds (asyncio keeps weak
    references), so a task it waits for can be destroyed pending. Here a cancel lands in the
    call's own task, which closes the servicer's generator before it ends."""

    async def write_all(requests: Any, context: grpc.aio.ServicerContext) -> None:
        responses = behavior(requests, context)
        async with contextlib.aclosing(responses):
            async for response in responses:
                await context.write(response)

    return write_all


def _internal(error: Exception, method: str) -> KvmeshError:
    if isinstance(error, grpc.aio.AbortError):
        raise error  # the servicer already chose a status
    if isinstance(error, NotImplementedError):
        return Unimplemented(f"{method} is not implemented by this server")
    log.exception("unhandled error in %s", method, exc_info=error)
    return Internal(f"internal error in {method}: {type(error).__name__}: {error}")


async def _report(context: grpc.aio.ServicerContext, error: KvmeshError, method: str) -> None:
    service, name = _method_labels(method)
    RPC_ERRORS.labels(service, name, error.status).inc()
    await abort_with_error(context, error)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Refuses callers the `guard` (if any) refuses, and turns kvmesh exceptions (and bugs)
    raised by any servicer into proper statuses.

    The guard runs in the handler, not here: a TLS caller's certificate is only on the call's
    context."""

    def __init__(self, draining: asyncio.Event, guard: MeshGuard | None = None) -> None:
        """draining: set once the server takes no new calls (each call's handler sees it:
        SERVER_DRAINING)."""
        self._draining = draining
        self._guard = guard

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        codec = {
            "request_deserializer": _tolerant(handler.request_deserializer),
            "response_serializer": handler.response_serializer,
        }
        of_server = (self._guard, self._draining)  # what each call's handler is given
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method, False, *of_server), **codec
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, method, True, *of_server), **codec
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method, False, *of_server), **codec
            )
        return grpc.stream_stream_rpc_method_handler(
            _wrap_stream(handler.stream_stream, method, True, *of_server), **codec
        )


def port_in_use_message(host: str, port: int, flag: str) -> str:
    return f"cannot listen on {host}:{port}: the port is in use (choose another with {flag})"


def bind_error(host: str, port: int) -> OSError | None:
    """Why host:port cannot be listened on now (EADDRINUSE: something listens there), or None."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As grpc does: a port whose last connections linger in TIME_WAIT is free to listen on.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as error:
            return error
    return None


def ensure_port_free(host: str, port: int, flag: str) -> None:
    """OSError naming the port when something already listens there. Checked before grpc
    binds, because grpc's own failure is a RuntimeError plus a C-core log line."""
    error = bind_error(host, port) if port else None
    if error is None:
        return
    if error.errno == errno.EADDRINUSE:
        raise OSError(port_in_use_message(host, port, flag))
    raise error


@dataclass
class GrpcServer:
    """A started-on-demand grpc.aio server hosting kvmesh services plus health and reflection."""

    config: ServerConfig
    service_name: str
    bindings: Sequence[ServiceBinding]
    on_stop: Sequence[StopHook] = ()
    shutdown_delay_s: float = 0.3
    port: int = 0
    metrics_port: int | None = None
    guard: MeshGuard | None = None
    """The membership check of an internal service (None: anyone may call)."""
    tls: TlsFiles | None = None
    """Serve over TLS with this certificate; an internal service (one with a guard) also asks
    every caller for a certificate signed by the stack's CA."""
    ready_extras: Mapping[str, object] = field(default_factory=dict)
    """More of the service's ports for its ready line (the gateway's http_port)."""
    _server: grpc.aio.Server | None = None
    _health: health.aio.HealthServicer = field(default_factory=health.aio.HealthServicer)
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _draining: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when grpc stops taking new calls (after the pause for load balancers)."""

    @property
    def serving(self) -> bool:
        """Started and not stopping: what its health service answers SERVING for."""
        return self._server is not None and not self._stopping.is_set()

    @property
    def address(self) -> str:
        """host:port that clients dial."""
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "[::]") else self.config.host
        return f"{host}:{self.port}"

    async def start(self) -> int:
        """Binds, starts serving and marks every service SERVING; returns the gRPC port."""
        # Both ports are checked before a server exists: a failed start leaves nothing behind.
        ensure_port_free(self.config.host, self.config.port, "--port")
        if self.config.metrics_port > 0:
            ensure_port_free(self.config.host, self.config.metrics_port, "--metrics-port")
        logging.getLogger(GRPC_AIO_LOGGER).addFilter(ENDED_CALL_FILTER)
        server = grpc.aio.server(
            interceptors=[TracingInterceptor(), ErrorInterceptor(self._draining, self.guard)],
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
                *SERVER_KEEPALIVE_OPTIONS,
            ],
        )
        for binding in self.bindings:
            binding.add_to_server(binding.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = [b.name for b in self.bindings]
        enable_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], server
        )
        bind = f"{self.config.host}:{self.config.port}"
        try:
            if self.tls is None:
                self.port = server.add_insecure_port(bind)
            else:
                internal = self.guard is not None
                credentials = self.tls.server_credentials(require_client_certificate=internal)
                self.port = server.add_secure_port(bind, credentials)
        except RuntimeError:  # grpc's "Failed to bind": lost a race for the port
            self.port = 0
        if self.port == 0:
            await server.stop(0)
            raise OSError(port_in_use_message(self.config.host, self.config.port, "--port"))
        await server.start()
        self._server = server
        for name in ["", *names]:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.config.metrics_port >= 0:
            self.metrics_port = await self._start_metrics(server)
        return self.port

    async def _start_metrics(self, server: grpc.aio.Server) -> int:
        """The Prometheus endpoint's port; a failure stops the gRPC server it belongs to."""
        try:
            http, _ = start_http_server(
                self.config.metrics_port, addr=self.config.metrics_host or self.config.host
            )
        except OSError as error:
            await server.stop(0)
            if error.errno != errno.EADDRINUSE:
                raise
            where = (self.config.host, self.config.metrics_port, "--metrics-port")
            raise OSError(port_in_use_message(*where)) from None
        port: int = http.server_port
        return port

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING first, a short pause for load balancers, then stop(grace) and the hooks."""
        if self._server is None or self._stopping.is_set():
            return
        self._stopping.set()
        await self._health.enter_graceful_shutdown()
        await asyncio.sleep(self.shutdown_delay_s)
        self._draining.set()
        await self._server.stop(self.config.grace_s if grace is None else grace)
        for hook in self.on_stop:
            await hook()

    async def wait(self) -> None:
        """Returns when the server has stopped."""
        if self._server is not None:
            await self._server.wait_for_termination()

    def ready_line(self) -> str:
        """The machine-readable line printed once serving (parsed by `kvmesh up` and tests)."""
        info = {
            "service": self.service_name,
            "address": self.address,
            "port": self.port,
            "metrics_port": self.metrics_port,
            **self.ready_extras,
        }
        return READY_PREFIX + json.dumps(info)


def configure_logging(config: ServerConfig, service_name: str) -> None:
    """One log format for every service, naming the service on each line."""
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {service_name} %(name)s: %(message)s",
        stream=sys.stderr,
    )


STARTUP_ERRORS = (OSError, ValueError, KvmeshError)
"""What a service's start raises for a user's mistake: a port in use, a missing or malformed
file or setting, a model that does not load."""


def run_service_main(service_name: str, main: Callable[[], object]) -> int:
    """Runs a service's `main`; a user's mistake at start ends it with one line on stderr and
    exit code 2 instead of a traceback (the traceback is logged at debug level)."""
    try:
        die_with_supervisor(os.environ)
        main()
    except (*STARTUP_ERRORS, SupervisorGone) as error:
        log.debug("%s failed to start", service_name, exc_info=True)
        print(f"{service_name}: error: {error}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


async def serve(server: GrpcServer) -> None:
    """Starts `server`, prints its ready line, and runs until SIGTERM or SIGINT."""
    setup_tracing(server.service_name)
    loop = asyncio.get_running_loop()
    stop_task: list[asyncio.Task[None]] = []

    def request_stop(signum: int) -> None:
        log.info("%s received %s: draining", server.service_name, signal.Signals(signum).name)
        if not stop_task:
            stop_task.append(loop.create_task(server.stop()))

    # Handlers go in before the ready line: a SIGTERM right after it must still drain.
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, request_stop, signum)
    started = time.monotonic()
    await server.start()
    if stop_task:  # a signal arrived while starting, when stop() had nothing to stop yet
        await server.stop()
    # What start-up built (modules, tokenizers, the model's objects) lives as long as the
    # process: kept out of the collector's full passes, which otherwise scan it all and
    # stalled a gateway's event loop ~90 ms at a time under load.
    gc.collect()
    gc.freeze()
    print(server.ready_line(), flush=True)
    log.info(
        "%s serving on %s (metrics port %s) after %.1fs",
        server.service_name,
        server.address,
        server.metrics_port,
        time.monotonic() - started,
    )
    await server.wait()
    if stop_task:
        await stop_task[0]
    log.info("%s stopped", server.service_name)
