"""The FastAPI application: OpenAI's routes, each a translation onto the gateway's admission.

POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health. Each request is
authenticated and run by the same Gateway the gRPC servicer calls, in this process. Every error
is OpenAI's error body with the status clients branch on (see translation.http_error); a body
that does not parse is a 400 naming the field, never a 500. A client that goes away, while
streaming or while waiting for a whole answer, cancels its requests at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry import context as otel_context
from opentelemetry import propagate
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from kvmesh.errors import InvalidArgument, KvmeshError
from kvmesh.tenants import Tenant
from kvmesh.v1 import common_pb2, gateway_pb2
from services.admission.auth import AUTHORIZATION
from services.admission.gateway import Gateway
from services.admission.openai_http import schemas, translation
from services.admission.openai_http.generation import ClientGone, Generate, Generation
from services.admission.openai_http.sse import DONE, event_stream
from services.admission.openai_http.translation import DoorHeaders, Plan

log = logging.getLogger(__name__)

JSON = "application/json"

Body = TypeVar("Body", bound=BaseModel)


@dataclass(slots=True, frozen=True)
class Door:
    """What the routes share: the gateway they admit through and the door's settings."""

    gateway: Gateway
    serving: Callable[[], bool]
    """Whether the gateway serves (False once it drains): GET /health's answer."""
    max_prompts: int
    """Most prompts in one /v1/completions request (each is its own request)."""

    def caller(self, headers: DoorHeaders) -> Tenant:
        """The tenant of the request's bearer key, as the gRPC servicer authenticates one."""
        key = headers.api_key
        return self.gateway.authenticate(((AUTHORIZATION, f"Bearer {key}"),) if key else ())

    def generate(self, tenant: Tenant) -> Generate:
        """Runs requests for `tenant` on the gateway. The door never sends a Cancel message:
        cancelling a request's task ends it, as a gRPC call's cancellation ends its handler."""

        def run(
            request: gateway_pb2.GenerateRequest, time_left_s: float | None
        ) -> AsyncIterator[common_pb2.GenerateEvent]:
            return self.gateway.generate(tenant, request, asyncio.Event(), time_left_s)

        return run


def error_response(error: KvmeshError, plan: Plan | None = None) -> Response:
    if isinstance(error, ClientGone):
        return Response(status_code=499)
    answer = translation.http_error(error, plan)
    return Response(
        answer.body.model_dump_json(), answer.status, headers=answer.headers, media_type=JSON
    )


class EventStream(StreamingResponse):
    """An SSE body written as its frames come, on the request's own task: starlette's
    StreamingResponse would add a task group with a second task listening for the client to
    leave, which the generation's own watch already does."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.stream_response(send)

    async def stream_response(self, send: Send) -> None:
        """As starlette's, but the frames ending in `data: [DONE]` end the body in the same
        write (starlette sends the end of a chunked body as a write of its own)."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        ended = False
        async for data in self.body_iterator:
            assert isinstance(data, bytes)
            ended = data.endswith(DONE)
            await send({"type": "http.response.body", "body": data, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _param(location: tuple[int | str, ...]) -> str:
    """("messages", 0, "role") -> "messages[0].role"."""
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "body"


async def _body(request: Request, model: type[Body]) -> Body:
    """The JSON body as `model`, parsed and validated by pydantic in one pass over the bytes (a
    FastAPI body parameter would first decode it to Python objects, and parse the content type
    with the email package, on every request); a 400 naming the first bad field otherwise."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as error:
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            detail = first.get("ctx", {}).get("error", "")
            raise InvalidArgument("body", f"not valid JSON ({detail})") from None
        raise InvalidArgument(_param(first["loc"]), first["msg"]) from None


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


async def answer(door: Door, plan: Plan, request: Request) -> Response:
    """Runs the plan's calls; the whole body, or an SSE stream of it. A client that leaves
    (streaming or not) cancels every call at once."""
    generation = Generation(plan, door.generate(door.caller(plan.headers)))
    generation.start(client_gone=_wait_disconnect(request))
    events = generation.events()
    if plan.stream:
        first = await anext(events)
        if first.error is not None:
            await generation.aclose()
            return error_response(first.error, plan)
        return EventStream(
            event_stream(plan, generation, events, first),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache"},
        )
    try:
        results = await generation.results()
    except KvmeshError as error:
        return error_response(error, plan)
    finally:
        await generation.aclose()
    offsets = [generation.offsets(i) for i in range(len(results))]
    body = translation.whole_response(plan, results, offsets)
    return Response(body.model_dump_json(), media_type=JSON)


@contextlib.contextmanager
def _caller_trace(request: Request) -> Iterator[None]:
    """Continues the caller's W3C trace (traceparent header) into the gateway call; a request
    with none of the propagators' headers has no trace to continue."""
    headers = request.headers
    if not any(name in headers for name in propagate.get_global_textmap().fields):
        yield
        return
    token = otel_context.attach(propagate.extract(dict(headers)))
    try:
        yield
    finally:
        otel_context.detach(token)


def create_app(door: Door) -> FastAPI:
    """The app of the door."""
    app = FastAPI(title="kvmesh OpenAI-compatible API")
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(KvmeshError, _kvmesh_error)

    # The two POSTs are starlette routes: FastAPI's own route handling (dependencies, its
    # exit stack) would run before every request reaches the gateway, for a Request argument.
    async def chat_completions(request: Request) -> Response:
        body = await _body(request, schemas.ChatCompletionRequest)
        plan = translation.chat_plan(body, DoorHeaders.parse(request.headers))
        with _caller_trace(request):
            return await answer(door, plan, request)

    async def completions(request: Request) -> Response:
        body = await _body(request, schemas.CompletionRequest)
        headers = DoorHeaders.parse(request.headers)
        plan = translation.completion_plan(body, headers, door.max_prompts)
        with _caller_trace(request):
            return await answer(door, plan, request)

    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        door.caller(DoorHeaders.parse(request.headers))
        cards = [
            schemas.ModelCard(
                id=m.id,
                max_model_len=m.context_length,
                base_model=m.base_model,
                available=m.available,
                fallback=m.fallback,
                usd_per_1k_tokens=m.usd_per_1k_tokens,
            )
            for m in (await door.gateway.list_models()).models
        ]
        return Response(schemas.ModelList(data=cards).model_dump_json(), media_type=JSON)

    @app.get("/health")
    async def health() -> Response:
        """200 while the gateway serves (its gRPC health check says SERVING), else 503."""
        serving = door.serving()
        return Response(
            b'{"status":"ok"}' if serving else b'{"status":"gateway unavailable"}',
            200 if serving else 503,
            media_type=JSON,
        )

    return app
