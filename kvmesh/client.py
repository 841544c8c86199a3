"""The kvmesh client SDK: `Client` (asyncio) and `SyncClient` (blocking) for the gateway.

    async with kvmesh.Client("127.0.0.1:50051") as client:
        result = await client.generate("Hello", max_tokens=32)
        async with client.stream("Tell me a story") as stream:
            async for chunk in stream:
                print(chunk.text, end="")

A prompt is text, a list of token ids, or a chat (a list of {"role", "content"} dicts, rendered
with the model's chat template by the gateway). Closing a stream before its end (`aclose()`,
leaving `async with`, or dropping it) cancels the request at every hop. Failures raise the
typed errors of `kvmesh.errors`, carrying the gRPC status and, where the server gave one, the
`retry_after_s` to wait before trying again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
from opentelemetry import propagate

from kvmesh.channels import CHANNEL_OPTIONS
from kvmesh.errors import Internal, InvalidArgument
from kvmesh.generate_many import GenerateManyCall, Generation
from kvmesh.rpc_status import error_from_rpc
from kvmesh.tls import client_credentials
from kvmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

T = TypeVar("T")

DEFAULT_TARGET = "127.0.0.1:50051"
TARGET_ENV = "KVMESH_TARGET"
API_KEY_ENV = "KVMESH_API_KEY"
CA_FILE_ENV = "KVMESH_CA_FILE"

PRIORITIES = {
    "interactive": common_pb2.PRIORITY_INTERACTIVE,
    "batch": common_pb2.PRIORITY_BATCH,
}
CACHE_POLICIES = {
    "use": common_pb2.CACHE_POLICY_USE,
    "bypass": common_pb2.CACHE_POLICY_BYPASS,
    "refresh": common_pb2.CACHE_POLICY_REFRESH,
}

PromptInput = str | Sequence[int] | Sequence[Mapping[str, Any]]
"""Text, token ids, or chat messages ({"role": ..., "content": ...}; an assistant turn may
carry "tool_calls" (ToolCallInfo items, as a result returned them), a "tool" turn the
"tool_call_id" its content answers)."""
TOOL_CHOICE_MODES = {
    "auto": common_pb2.TOOL_CHOICE_MODE_AUTO,
    "none": common_pb2.TOOL_CHOICE_MODE_NONE,
    "required": common_pb2.TOOL_CHOICE_MODE_REQUIRED,
}


@dataclass(slots=True, frozen=True)
class ToolCallInfo:
    """One tool call of an answer (finish_reason "tool_calls")."""

    id: str
    name: str
    arguments_json: str
    """The arguments object as JSON text; it validates against the tool's schema."""

    @property
    def arguments(self) -> Any:
        return json.loads(self.arguments_json)

    def to_proto(self) -> common_pb2.ToolCall:
        return common_pb2.ToolCall(id=self.id, name=self.name, arguments_json=self.arguments_json)


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """The log-probability of one generated token, and its most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log-probability) of the alternatives, most likely first."""

    @classmethod
    def from_proto(cls, entry: common_pb2.TokenLogprob) -> TokenLogprob:
        return cls(entry.token_id, entry.logprob, tuple((t.token_id, t.logprob) for t in entry.top))


@dataclass(slots=True, frozen=True)
class Chunk:
    """Tokens that arrived together, and the text they add."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token when the request asked for logprobs, else empty."""


@dataclass(slots=True, frozen=True)
class UsageInfo:
    """Token accounting and cost of one request."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    response_cache_hit: bool = False
    cost_usd: float = 0.0

    @classmethod
    def from_proto(cls, usage: common_pb2.Usage) -> UsageInfo:
        return cls(
            prompt_tokens=usage.prompt_tokens,
            cached_prompt_tokens=usage.cached_prompt_tokens,
            completion_tokens=usage.completion_tokens,
            response_cache_hit=usage.response_cache_hit,
            cost_usd=usage.cost_usd,
        )


@dataclass(slots=True)
class GenerationResult:
    """A finished generation."""

    text: str
    token_ids: list[int]
    finish_reason: str
    """"stop", "length", "abort", "deadline", "error" or "tool_calls"."""
    model: str
    """The tier that served the request."""
    request_id: str
    usage: UsageInfo
    fallback: bool = False
    """The requested tier had no healthy worker and a cheaper one served instead."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One per token when the request asked for logprobs."""
    queue_ms: float = 0.0
    ttft_ms: float | None = None
    """None when no token was produced."""
    e2e_ms: float = 0.0
    placement_reason: str = ""
    error_message: str = ""
    tool_calls: list[ToolCallInfo] = field(default_factory=list)
    """The parsed calls when finish_reason is "tool_calls"."""

    def to_json(self) -> dict[str, Any]:
        """The CLI's --json object."""
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "model": self.model,
            "request_id": self.request_id,
            "usage": asdict(self.usage),
            "timings": {"queue_ms": self.queue_ms, "ttft_ms": self.ttft_ms, "e2e_ms": self.e2e_ms},
        }


def resolve_target(target: str | None) -> str:
    """The gateway to dial: `target`, else $KVMESH_TARGET, else 127.0.0.1:50051."""
    return target or os.environ.get(TARGET_ENV) or DEFAULT_TARGET


def resolve_api_key(api_key: str | None) -> str:
    """The tenant key to send: `api_key` (even ""), else $KVMESH_API_KEY, else none."""
    return api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")


def resolve_ca_file(ca_file: str | Path | None) -> Path | None:
    """The CA that verifies a gateway served over TLS: `ca_file`, else $KVMESH_CA_FILE, else
    none (plaintext)."""
    chosen = ca_file or os.environ.get(CA_FILE_ENV)
    return Path(chosen).expanduser() if chosen else None


def gateway_channel(target: str, ca_file: Path | None) -> grpc.aio.Channel:
    """A channel to the gateway: over TLS verified with `ca_file` when given, else plaintext."""
    if ca_file is None:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(target, client_credentials(ca_file), options=CHANNEL_OPTIONS)


def build_request(
    prompt: PromptInput,
    *,
    model: str = "",
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    logprobs: int | None = None,
    ignore_eos: bool = False,
    priority: str = "interactive",
    cache_policy: str = "use",
    idempotency_key: str = "",
    request_id: str = "",
    labels: Mapping[str, str] | None = None,
    json_schema: str | Mapping[str, Any] | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    grammar_notation: str = "ebnf",
    tools: Sequence[Mapping[str, Any]] = (),
    tool_choice: str = "auto",
) -> gateway_pb2.GenerateRequest:
    """The GenerateRequest for these arguments (ValueError for an unknown priority or policy,
    or for more than one output constraint).

    At most one constraint shapes the answer: a JSON Schema (text or a dict), any JSON object,
    a regex, a choice of strings, or a grammar (`grammar_notation` "ebnf" or "lark").

    `tools` (chat prompts only): {"name", "description", "parameters": JSON Schema dict};
    `tool_choice` "auto", "none", "required", or the name of the tool to call."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}")
    if cache_policy not in CACHE_POLICIES:
        raise ValueError(f"cache_policy must be one of {', '.join(CACHE_POLICIES)}")
    sampling = common_pb2.SamplingParams(stop=list(stop), ignore_eos=ignore_eos)
    _set_unsigned(sampling, "max_tokens", max_tokens, UINT32_MAX)
    if temperature is not None:
        sampling.temperature = temperature
    if top_p is not None:
        sampling.top_p = top_p
    _set_unsigned(sampling, "top_k", top_k, UINT32_MAX)
    _set_unsigned(sampling, "seed", seed, UINT64_MAX)
    _set_unsigned(sampling, "logprobs", logprobs, UINT32_MAX)
    _set_constraint(sampling, json_schema, json_object, regex, choice, grammar, grammar_notation)
    built_prompt = _prompt(prompt)
    if tools:
        if not built_prompt.HasField("chat"):
            raise ValueError("tools need a chat prompt (a list of messages)")
        _set_tools(built_prompt.chat, tools, tool_choice)
    return gateway_pb2.GenerateRequest(
        request_id=request_id,
        idempotency_key=idempotency_key,
        model=model,
        prompt=built_prompt,
        sampling=sampling,
        priority=PRIORITIES[priority],  # type: ignore[arg-type]
        cache_policy=CACHE_POLICIES[cache_policy],  # type: ignore[arg-type]
        labels=dict(labels or {}),
    )


GRAMMAR_NOTATIONS = {
    "ebnf": common_pb2.GRAMMAR_NOTATION_EBNF,
    "lark": common_pb2.GRAMMAR_NOTATION_LARK,
}


def _set_constraint(
    sampling: common_pb2.SamplingParams,
    json_schema: str | Mapping[str, Any] | None,
    json_object: bool,
    regex: str | None,
    choice: Sequence[str] | None,
    grammar: str | None,
    grammar_notation: str,
) -> None:
    given = {
        "json_schema": json_schema is not None,
        "json_object": json_object,
        "regex": regex is not None,
        "choice": choice is not None,
        "grammar": grammar is not None,
    }
    if sum(given.values()) > 1:
        named = ", ".join(name for name, set_ in given.items() if set_)
        raise ValueError(f"at most one output constraint, got {named}")
    if json_schema is not None:
        sampling.json_schema = (
            json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        )
    elif json_object:
        sampling.json_object = True
    elif regex is not None:
        sampling.regex = regex
    elif choice is not None:
        sampling.choice.options.extend(choice)
    elif grammar is not None:
        if grammar_notation not in GRAMMAR_NOTATIONS:
            raise ValueError(f"grammar_notation must be one of {', '.join(GRAMMAR_NOTATIONS)}")
        sampling.grammar.notation = GRAMMAR_NOTATIONS[grammar_notation]
        sampling.grammar.source = grammar


UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


def _set_unsigned(
    sampling: common_pb2.SamplingParams, name: str, value: int | None, most: int
) -> None:
    """Sets an unsigned sampling field, refusing what the wire type cannot hold (protobuf's
    own ValueError does not say which field)."""
    if value is None:
        return
    if not 0 <= value <= most:
        raise InvalidArgument(f"sampling.{name}", f"must be between 0 and {most}, got {value}")
    setattr(sampling, name, value)


def _prompt(prompt: PromptInput) -> common_pb2.Prompt:
    if isinstance(prompt, str):
        return common_pb2.Prompt(text=prompt)
    items: list[Any] = list(prompt)
    if items and all(isinstance(item, Mapping) for item in items):
        messages = [_chat_message(m) for m in items]
        return common_pb2.Prompt(
            chat=common_pb2.ChatMessages(messages=messages, add_generation_prompt=True)
        )
    if all(isinstance(item, int) for item in items):
        return common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=items))
    raise TypeError("prompt must be text, a list of token ids, or a list of chat messages")


def _chat_message(message: Mapping[str, Any]) -> common_pb2.ChatMessage:
    calls = [
        call.to_proto() if isinstance(call, ToolCallInfo) else common_pb2.ToolCall(**call)
        for call in message.get("tool_calls", ())
    ]
    return common_pb2.ChatMessage(
        role=str(message["role"]),
        content=str(message.get("content", "")),
        tool_calls=calls,
        tool_call_id=str(message.get("tool_call_id", "")),
    )


def _set_tools(
    chat: common_pb2.ChatMessages, tools: Sequence[Mapping[str, Any]], tool_choice: str
) -> None:
    for tool in tools:
        parameters = tool.get("parameters")
        chat.tools.append(
            common_pb2.ToolDefinition(
                name=str(tool["name"]),
                description=str(tool.get("description", "")),
                parameters_json_schema="" if parameters is None else json.dumps(parameters),
            )
        )
    if tool_choice in TOOL_CHOICE_MODES:
        chat.tool_choice.mode = TOOL_CHOICE_MODES[tool_choice]
    else:
        chat.tool_choice.mode = common_pb2.TOOL_CHOICE_MODE_NAMED
        chat.tool_choice.name = tool_choice


@dataclass(slots=True)
class GenerationRecord:
    """What one generation's events said so far; its result once Finished arrived.

    The gateway's events as the SDK's Chunks and GenerationResult, for any reader of them (this
    module's stream of a gRPC call, the gateway's own HTTP door)."""

    started: common_pb2.Started | None = None
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: common_pb2.Finished | None = None

    def record(self, event: common_pb2.GenerateEvent) -> Chunk | None:
        """Notes one event; the chunk when it was one."""
        kind = event.WhichOneof("event")
        if kind == "started":
            self.started = event.started
        elif kind == "chunk":
            logprobs = tuple(TokenLogprob.from_proto(e) for e in event.chunk.logprobs)
            self.token_ids.extend(event.chunk.token_ids)
            self.text.append(event.chunk.text)
            self.logprobs.extend(logprobs)
            return Chunk(event.chunk.text, tuple(event.chunk.token_ids), logprobs)
        elif kind == "finished":
            self.finished = event.finished
        return None

    def result(self) -> GenerationResult:
        """The finished generation (raises RuntimeError before Finished arrived)."""
        finished = self.finished
        if finished is None:
            raise RuntimeError("the stream has not finished yet")
        started = self.started or common_pb2.Started()
        return GenerationResult(
            text="".join(self.text),
            token_ids=list(self.token_ids),
            finish_reason=common_pb2.FinishReason.Name(finished.finish_reason)
            .removeprefix("FINISH_REASON_")
            .lower(),
            model=started.model,
            request_id=started.request_id,
            usage=UsageInfo.from_proto(finished.usage),
            fallback=started.placement.fallback,
            logprobs=list(self.logprobs),
            queue_ms=finished.timings.queue_ms,
            ttft_ms=finished.timings.ttft_ms if finished.timings.HasField("ttft_ms") else None,
            e2e_ms=finished.timings.e2e_ms,
            placement_reason=started.placement.reason,
            error_message=finished.error_message,
            tool_calls=[
                ToolCallInfo(call.id, call.name, call.arguments_json)
                for call in finished.tool_calls
            ],
        )


GenerationOpener = Callable[[gateway_pb2.GenerateManyClientMessage, float | None], Generation]
"""Opens a generation on the client's GenerateMany call: its opening message, its deadline."""


class GenerationStream:
    """The chunks of one generation, as they arrive; `result` once the stream has ended.

    The request starts on the first read, on the client's shared Gateway.GenerateMany call.
    Closing the stream early, or dropping it, cancels the request.
    """

    def __init__(
        self,
        open_generation: GenerationOpener,
        request: gateway_pb2.GenerateRequest,
        deadline_s: float | None,
    ) -> None:
        self._open_generation = open_generation
        self._request = request
        self._deadline_s = deadline_s
        self._generation: Generation | None = None
        self._progress = GenerationRecord()

    def _opened(self) -> Generation:
        """The request's generation, opened on first use."""
        if self._generation is None:
            opening = gateway_pb2.GenerateManyClientMessage(request=self._request)
            generation = self._generation = self._open_generation(opening, self._deadline_s)
            # A stream nobody references any more cancels its request (as gRPC cancels a call
            # of its own when collected): the finalizer holds the generation, not the stream.
            weakref.finalize(self, _drop, asyncio.get_running_loop(), generation)
        return self._generation

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> Chunk:
        while self._progress.finished is None:
            chunk = await self._next_event()
            if chunk is not None:
                return chunk
        raise StopAsyncIteration

    async def wait_started(self) -> common_pb2.Started:
        """The Started event (model tier, placement, cache hit), read before any chunk.

        Raises the typed error when the gateway refuses the request."""
        while self._progress.started is None and self._progress.finished is None:
            if await self._next_event() is not None:
                raise Internal("the gateway sent tokens before its Started event")
        return self._progress.started or common_pb2.Started()

    async def _next_event(self) -> Chunk | None:
        """Reads one event and records it; the chunk when it was one."""
        event = await self._opened().next_event()
        if event is None:
            raise Internal("the gateway ended the stream without a Finished event")
        return self._progress.record(event)

    async def cancel(self, reason: str = "cancelled by the client") -> GenerationResult:
        """Asks the gateway to stop; returns the partial result (finish reason "abort")."""
        if self._progress.finished is None:
            self._opened().cancel(reason)
            async for _ in self:
                pass
        return self.result

    async def aclose(self) -> None:
        """Ends the stream; a request still running is cancelled at every hop."""
        if self._generation is not None:
            self._generation.close("cancelled by the client")

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def result(self) -> GenerationResult:
        """The finished generation (raises RuntimeError before the stream has ended)."""
        return self._progress.result()


def _drop(loop: asyncio.AbstractEventLoop, generation: Generation) -> None:
    """Closes a dropped stream's generation on its loop (a collector may run on any thread)."""
    with contextlib.suppress(RuntimeError):  # the loop has closed: so has the call
        loop.call_soon_threadsafe(generation.close, "the client dropped the stream")


class Client:
    """Asynchronous client of the admission gateway."""

    def __init__(
        self,
        target: str | None = None,
        *,
        api_key: str | None = None,
        channel: grpc.aio.Channel | None = None,
        ca_file: str | Path | None = None,
    ) -> None:
        """`target` defaults to $KVMESH_TARGET or 127.0.0.1:50051, `api_key` to $KVMESH_API_KEY,
        `ca_file` (a gateway served over TLS) to $KVMESH_CA_FILE."""
        self.target = resolve_target(target)
        key = resolve_api_key(api_key)
        self._api_key_metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {key}"),) if key else ()
        )
        # No client interceptors: their wrapping of streaming calls keeps a cancelled or
        # dropped stream alive; the caller's trace context is injected per call instead.
        self._channel = channel or gateway_channel(self.target, resolve_ca_file(ca_file))
        self._owns_channel = channel is None
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._many: GenerateManyCall[gateway_pb2.GenerateManyClientMessage] | None = None

    def stream(
        self, prompt: PromptInput, *, deadline_s: float | None = None, **options: Any
    ) -> GenerationStream:
        """Streams a generation; `options` are those of `build_request`."""
        return self.stream_request(build_request(prompt, **options), deadline_s=deadline_s)

    def stream_request(
        self, request: gateway_pb2.GenerateRequest, *, deadline_s: float | None = None
    ) -> GenerationStream:
        """Streams a prepared request (see `build_request`)."""
        return GenerationStream(self._generation, request, deadline_s)

    def _generation(
        self, opening: gateway_pb2.GenerateManyClientMessage, deadline_s: float | None
    ) -> Generation:
        """Opens a generation on the client's GenerateMany call (a new one once the last has
        half-closed), under the caller's current trace context."""
        if self._many is None or not self._many.takes_more:
            self._many = GenerateManyCall(
                functools.partial(self._stub.GenerateMany, metadata=self._api_key_metadata),
                gateway_pb2.GenerateManyClientMessage,
                "the gateway",
            )
        return self._many.generate(opening, deadline_s)

    async def generate(
        self, prompt: PromptInput, *, deadline_s: float | None = None, **options: Any
    ) -> GenerationResult:
        """Runs a generation to its end and returns it."""
        async with self.stream(prompt, deadline_s=deadline_s, **options) as stream:
            async for _ in stream:
                pass
            return stream.result

    async def list_models(self) -> list[gateway_pb2.ModelInfo]:
        """The model tiers and their prices."""
        response = await self._unary(
            self._stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=self._metadata())
        )
        return list(response.models)

    async def usage(self, tenant: str = "") -> gateway_pb2.UsageResponse:
        """Metered usage of the caller's tenant (or another, for admins)."""
        response: gateway_pb2.UsageResponse = await self._unary(
            self._stub.Usage(gateway_pb2.UsageRequest(tenant=tenant), metadata=self._metadata())
        )
        return response

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        """The API key, and the W3C trace context of the caller's current span if any."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        return (*self._api_key_metadata, *carrier.items())

    @staticmethod
    async def _unary(call: Any) -> Any:
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from None

    async def close(self) -> None:
        if self._owns_channel:
            await self._channel.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()


class SyncClient:
    """Blocking client: the asynchronous one driven by an event loop on a private thread."""

    def __init__(
        self,
        target: str | None = None,
        *,
        api_key: str | None = None,
        ca_file: str | Path | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvmesh-client", daemon=True
        )
        self._thread.start()
        self._client = self._run(_make_client(target, api_key, ca_file))
        self.target = self._client.target

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def generate(
        self, prompt: PromptInput, *, deadline_s: float | None = None, **options: Any
    ) -> GenerationResult:
        """Runs a generation to its end and returns it."""
        return self._run(self._client.generate(prompt, deadline_s=deadline_s, **options))

    def stream(
        self, prompt: PromptInput, *, deadline_s: float | None = None, **options: Any
    ) -> Generator[Chunk, None, GenerationResult]:
        """Yields chunks as they arrive; closing the iterator early cancels the request.

        The generator returns the GenerationResult (StopIteration.value) at the end.
        """
        stream = self._client.stream(prompt, deadline_s=deadline_s, **options)
        try:
            while (chunk := self._run(_next_chunk(stream))) is not None:
                yield chunk
        finally:
            if self._loop.is_running():
                self._run(stream.aclose())
        return stream.result

    def list_models(self) -> list[gateway_pb2.ModelInfo]:
        return self._run(self._client.list_models())

    def usage(self, tenant: str = "") -> gateway_pb2.UsageResponse:
        return self._run(self._client.usage(tenant))

    def close(self) -> None:
        """Closes the channel and stops the private loop."""
        if not self._loop.is_running():
            return
        self._run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


async def _make_client(
    target: str | None, api_key: str | None, ca_file: str | Path | None
) -> Client:
    """Builds the client on the loop that will use it (channels bind to their loop)."""
    return Client(target, api_key=api_key, ca_file=ca_file)


async def _next_chunk(stream: AsyncIterator[Chunk]) -> Chunk | None:
    """The next chunk, or None at the end (StopAsyncIteration cannot cross threads)."""
    return await anext(stream, None)
