"""Prometheus metrics of the OpenAI HTTP door (the gateway keeps its own on its port)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client import Counter

HTTP_RESPONSES = Counter(
    "kvmesh:http_responses",
    "Responses of the OpenAI HTTP door, by route and HTTP status.",
    ["route", "status"],
)

ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class CountResponses:
    """ASGI middleware counting each response's status as it starts (streams included)."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                HTTP_RESPONSES.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
