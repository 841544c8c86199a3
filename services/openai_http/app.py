"""The FastAPI application: OpenAI's routes, each a translation onto `Gateway.Generate`.

POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health. Every error is
OpenAI's error body with the status clients branch on (see translation.http_error); a body
that does not parse is a 400 naming the field, never a 500. A client that goes away, while
streaming or while waiting for a whole answer, cancels its calls at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmesh.client import Client, gateway_channel
from kvmesh.errors import InvalidArgument, KvmeshError
from services.openai_http import schemas, translation
from services.openai_http.config import OpenAIHttpConfig
from services.openai_http.generation import Generation
from services.openai_http.sse import event_stream
from services.openai_http.translation import DoorHeaders, Plan

log = logging.getLogger(__name__)

T = TypeVar("T")

JSON = "application/json"


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


@dataclass(slots=True)
class Door:
    """What the routes share: the settings and the one channel to the gateway."""

    config: OpenAIHttpConfig
    channel: grpc.aio.Channel | None = None

    @property
    def gateway(self) -> grpc.aio.Channel:
        assert self.channel is not None, "the app's lifespan opens the channel"
        return self.channel


def error_response(error: KvmeshError, plan: Plan | None = None) -> Response:
    answer = translation.http_error(error, plan)
    return Response(
        answer.body.model_dump_json(), answer.status, headers=answer.headers, media_type=JSON
    )


def _param(location: tuple[Any, ...]) -> str:
    """("body", "messages", 0, "role") -> "messages[0].role"."""
    text = ""
    for part in location[1:] if location and location[0] == "body" else location:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "body"


async def _validation_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, RequestValidationError)
    first = error.errors()[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return error_response(InvalidArgument("body", f"not valid JSON ({detail})"))
    param = _param(tuple(first.get("loc", ())))
    return error_response(InvalidArgument(param, str(first.get("msg", "invalid value"))))


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, StarletteHTTPException)
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    body = schemas.ErrorBody(error=schemas.ErrorDetail(message=str(error.detail), type=kind))
    return Response(body.model_dump_json(), error.status_code, media_type=JSON)


async def _kvmesh_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, KvmeshError)
    return error_response(error)


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client closes its connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, KvmeshError):
            await task
        raise ClientGone
    return task.result()


async def answer(door: Door, plan: Plan, request: Request) -> Response:
    """Runs the plan's calls; the whole body, or an SSE stream of it."""
    generation = Generation(plan, door.gateway)
    generation.start()
    events = generation.events()
    try:
        if plan.stream:
            first = await _unless_gone(request, anext(events))
            if first.error is not None:
                await generation.aclose()
                return error_response(first.error, plan)
            return StreamingResponse(
                event_stream(plan, generation, events, first),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        results = await _unless_gone(request, generation.results())
    except ClientGone:
        await generation.aclose()
        return Response(status_code=499)
    except KvmeshError as error:
        await generation.aclose()
        return error_response(error, plan)
    await generation.aclose()
    offsets = [generation.offsets(i) for i in range(len(results))]
    body = translation.whole_response(plan, results, offsets)
    return Response(body.model_dump_json(), media_type=JSON)


@contextlib.contextmanager
def _caller_trace(request: Request) -> Iterator[None]:
    """Continues the caller's W3C trace (traceparent header) into the gateway call."""
    token = otel_context.attach(propagate.extract(dict(request.headers)))
    try:
        yield
    finally:
        otel_context.detach(token)


def create_app(config: OpenAIHttpConfig) -> FastAPI:
    """The app for these settings; its lifespan opens and closes the gateway channel."""
    door = Door(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Over TLS when the gateway is (kvmesh up --tls passes the stack's CA).
        door.channel = gateway_channel(config.gateway, config.tls_ca_file)
        yield
        await door.channel.close()

    app = FastAPI(title="kvmesh OpenAI-compatible API", lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(KvmeshError, _kvmesh_error)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: schemas.ChatCompletionRequest, request: Request) -> Response:
        plan = translation.chat_plan(body, DoorHeaders.parse(request.headers))
        with _caller_trace(request):
            return await answer(door, plan, request)

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, request: Request) -> Response:
        headers = DoorHeaders.parse(request.headers)
        plan = translation.completion_plan(body, headers, config.max_prompts)
        with _caller_trace(request):
            return await answer(door, plan, request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        client = Client(channel=door.gateway, api_key=DoorHeaders.parse(request.headers).api_key)
        cards = [
            schemas.ModelCard(
                id=m.id,
                max_model_len=m.context_length,
                base_model=m.base_model,
                available=m.available,
                fallback=m.fallback,
                usd_per_1k_tokens=m.usd_per_1k_tokens,
            )
            for m in await client.list_models()
        ]
        return Response(schemas.ModelList(data=cards).model_dump_json(), media_type=JSON)

    @app.get("/health")
    async def health() -> Response:
        """200 while the gateway behind the door reports SERVING, else 503."""
        stub = health_pb2_grpc.HealthStub(door.gateway)
        try:
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(), timeout=config.health_timeout_s
            )
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            serving = False
        return Response(
            b'{"status":"ok"}' if serving else b'{"status":"gateway unavailable"}',
            200 if serving else 503,
            media_type=JSON,
        )

    return app
