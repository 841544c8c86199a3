"""Pydantic models of the OpenAI request and response bodies the door speaks.

Requests ignore fields they do not know, as OpenAI's API does; the fields kvmesh cannot honour
are declared (as `Any`) only so that translation can refuse them by name. Responses follow
OpenAI's shapes, plus kvmesh's own fields, each named `kvmesh...` or documented as an extra.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    """`stream_options`: only `include_usage` means anything."""

    include_usage: bool = False


class ChatMessageIn(_Request):
    """One turn; content is a string or a list of {"type": "text", "text": ...} parts; an
    assistant turn may carry tool calls, a tool turn the id of the call it answers."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class GenerationFields(_Request):
    """The fields chat and completions requests share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None
    # kvmesh's controls and vLLM's usual extras, as extra body fields.
    priority: Literal["interactive", "batch"] = "interactive"
    cache_policy: Literal["use", "bypass", "refresh"] = "use"
    top_k: int | None = None
    ignore_eos: bool = False
    # Refused by name when set to anything but their neutral value (see translation.REFUSED).
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    best_of: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None


class ChatCompletionRequest(GenerationFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(GenerationFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: Any = None


# --- responses -------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens served from a worker's prefix cache."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    cost_usd: float = 0.0
    """kvmesh extra: what the request cost, in US dollars."""
    response_cache_hit: bool = False
    """kvmesh extra: every answer came from kvmesh's response cache."""


class KvmeshInfo(BaseModel):
    """kvmesh's extra object on a response: which tier served it and why."""

    requested_model: str
    """The model the request named."""
    fallback: bool
    """The requested tier had no healthy worker and a cheaper one (`model`) served instead."""
    request_ids: list[str]
    """The gateway's request id of each choice, in choice order."""


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """The arguments object as JSON text."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    """None when the answer is only a tool call."""
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        body: dict[str, Any] = handler(self)
        if body.get("tool_calls") is None:
            body.pop("tool_calls", None)
        return body


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str
    kvmesh_finish_reason: str
    """kvmesh extra: the gateway's own reason (stop, length, deadline, abort)."""


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kvmesh: KvmeshInfo


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str
    kvmesh_finish_reason: str
    """kvmesh extra: the gateway's own reason (stop, length, deadline, abort)."""


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    kvmesh: KvmeshInfo


class ToolCallDelta(BaseModel):
    """A tool call in a stream: the door sends each call whole, in one delta."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Delta(BaseModel):
    """What a chunk adds; OpenAI leaves out the keys a delta does not carry."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _without_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    kvmesh_finish_reason: str | None = None
    """kvmesh extra, on the finish chunk only."""


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    kvmesh: KvmeshInfo | None = None
    """kvmesh extra, on the finish chunks and the usage chunk only."""


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    kvmesh_finish_reason: str | None = None
    """kvmesh extra, on the finish chunk only."""


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
    kvmesh: KvmeshInfo | None = None
    """kvmesh extra, on the finish chunks and the usage chunk only."""


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "kvmesh"
    max_model_len: int
    """Longest prompt + output, in tokens (vLLM's name for it)."""
    base_model: str
    available: bool
    fallback: str
    usd_per_1k_tokens: float


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail = Field(...)
