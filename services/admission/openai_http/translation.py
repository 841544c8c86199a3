"""OpenAI request bodies to GenerateRequests, and the gateway's answers back to OpenAI bodies.

Pure translation: no HTTP, no gRPC calls. Every check here is about the OpenAI shape (which
fields exist, which kvmesh cannot honour); the values themselves are checked by the gateway,
whose field names `openai_param` turns back into the request's own.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvmesh.client import (
    UINT32_MAX,
    GenerationResult,
    PromptInput,
    TokenLogprob,
    build_request,
)
from kvmesh.errors import InvalidArgument, KvmeshError
from kvmesh.tool_format import split_answer
from kvmesh.v1 import gateway_pb2
from services.admission.openai_http import schemas

Kind = Literal["chat", "completion"]
ToolAnswer = Literal["text", "auto", "call"]
"""What an answer holds: text only (no tools, or tool_choice none), text that may end with a
tagged call (auto), or only a call (required, a named function)."""

MAX_N = 8
"""Most samples (`n`) per prompt."""
DEADLINE_HEADER = "x-kvmesh-timeout-s"
"""Seconds the caller will wait for the whole answer: the deadline of its gateway requests."""
IDEMPOTENCY_HEADER = "idempotency-key"
DEFAULT_TEMPERATURE = 1.0
"""OpenAI's default when a request sets none (kvmesh's own gRPC default is greedy)."""
CHAT_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
"""OpenAI roles -> the chat template's roles ("developer" is OpenAI's newer name for system)."""

FINISH_REASONS = {
    "stop": "stop",
    "length": "length",
    "deadline": "length",
    "abort": "stop",
    "tool_calls": "tool_calls",
}
"""kvmesh finish reasons -> OpenAI's; a deadline ends the answer as "length" (partial output)."""


def _is_set(value: Any) -> bool:
    return value not in (None, [], {}, "")


REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (_is_set, "the deprecated functions field is not supported; use tools"),
    "function_call": (
        lambda v: _is_set(v) and v != "none",
        "the deprecated function_call field is not supported; use tool_choice",
    ),
    "logit_bias": (_is_set, "kvmesh does not support logit_bias"),
    "presence_penalty": (lambda v: _is_set(v) and v != 0, "kvmesh does not support penalties"),
    "frequency_penalty": (lambda v: _is_set(v) and v != 0, "kvmesh does not support penalties"),
    "repetition_penalty": (lambda v: _is_set(v) and v != 1, "kvmesh does not support penalties"),
    "best_of": (lambda v: _is_set(v) and v != 1, "kvmesh does not support best_of; use n"),
    "audio": (_is_set, "kvmesh serves text only"),
    "modalities": (lambda v: _is_set(v) and v != ["text"], "kvmesh serves text only"),
    "prediction": (_is_set, "predicted outputs are not supported"),
    "suffix": (_is_set, "kvmesh does not support suffix (insertion)"),
}
"""Fields kvmesh cannot honour: a 400 naming them when set to anything but a neutral value."""


@dataclass(slots=True, frozen=True)
class DoorHeaders:
    """What the door reads from the HTTP headers."""

    api_key: str
    """The bearer token of `Authorization: Bearer <key>`, the tenant's API key."""
    idempotency_key: str = ""
    deadline_s: float | None = None
    """From the X-Kvmesh-Timeout-S header."""

    @classmethod
    def parse(cls, headers: Mapping[str, str]) -> DoorHeaders:
        authorization = headers.get("authorization", "")
        scheme, _, token = authorization.partition(" ")
        api_key = token.strip() if scheme.lower() == "bearer" else ""
        raw_deadline = headers.get(DEADLINE_HEADER)
        deadline_s = None
        if raw_deadline is not None:
            try:
                deadline_s = float(raw_deadline)
            except ValueError:
                deadline_s = math.nan
            if not (math.isfinite(deadline_s) and deadline_s > 0):
                raise InvalidArgument(
                    "X-Kvmesh-Timeout-S",
                    f"must be a positive number of seconds, got {raw_deadline!r}",
                )
        return cls(api_key, headers.get(IDEMPOTENCY_HEADER, ""), deadline_s)


@dataclass(slots=True)
class Plan:
    """An OpenAI request as gateway requests: one per choice, in choice order."""

    kind: Kind
    requested_model: str
    requests: list[gateway_pb2.GenerateRequest]
    prompt_of: list[int]
    """Index of the prompt each choice answers (several only for a completions list)."""
    headers: DoorHeaders
    stream: bool
    include_usage: bool
    logprobs: bool
    max_tokens_param: str
    """Which field carried max_tokens, to name it in errors."""
    tool_answer: ToolAnswer = "text"
    created: int = field(default_factory=lambda: int(time.time()))

    def first_of_prompt(self, choice: int) -> bool:
        """The choice is its prompt's first sample (started first, to fill the prefix cache)."""
        return choice == 0 or self.prompt_of[choice - 1] != self.prompt_of[choice]


def refuse_unsupported(body: schemas.GenerationFields) -> None:
    for name, (refused, why) in REFUSED.items():
        if refused(getattr(body, name, None)):
            raise InvalidArgument(name, why)


def _generation_options(
    body: schemas.GenerationFields, max_tokens: int | None, logprobs: int | None
) -> dict[str, Any]:
    if not 1 <= body.n <= MAX_N:
        raise InvalidArgument("n", f"must be between 1 and {MAX_N}")
    labels = dict(body.metadata or {})
    if body.user:
        labels["user"] = body.user
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return _response_format(body.response_format) | {
        "model": body.model,
        "max_tokens": max_tokens,
        "temperature": DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": stop,
        "logprobs": logprobs,
        "ignore_eos": body.ignore_eos,
        "priority": body.priority,
        "cache_policy": body.cache_policy,
        "labels": labels,
    }


def _response_format(value: Any) -> dict[str, Any]:
    """`response_format` as the SDK's constraint options: text (none), json_object, or
    json_schema (its `schema`; kvmesh enforces it whether or not `strict` is set)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument("response_format", "must be an object with a type")
    kind = value.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise InvalidArgument(
            "response_format.type", f"must be text, json_object or json_schema, got {kind!r}"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise InvalidArgument("response_format.json_schema.schema", "must be a JSON Schema object")
    if not isinstance(spec.get("strict", False), bool | None):
        raise InvalidArgument("response_format.json_schema.strict", "must be true or false")
    return {"json_schema": spec["schema"]}


def _tool_options(body: schemas.ChatCompletionRequest) -> tuple[dict[str, Any], ToolAnswer]:
    """`tools` and `tool_choice` as the SDK's options, and what the answer will hold."""
    tools = [_tool(index, tool) for index, tool in enumerate(body.tools or [])]
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict):
            raise InvalidArgument("tool_choice", "must name a function: {type, function: {name}}")
        choice = str(function.get("name", ""))
        answer: ToolAnswer = "call"
    elif choice in ("auto", "none", "required"):
        answer = {"auto": "auto", "none": "text", "required": "call"}[choice]  # type: ignore[assignment]
    else:
        raise InvalidArgument(
            "tool_choice", "must be auto, none, required or {type: function, function: {name}}"
        )
    if not tools:
        if choice != "none":
            raise InvalidArgument("tool_choice", "a tool choice other than none needs tools")
        return {}, "text"
    return {"tools": tools, "tool_choice": choice}, answer


def _tool(index: int, tool: Any) -> dict[str, Any]:
    param = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidArgument(f"{param}.type", "only function tools are supported")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidArgument(f"{param}.function.name", "must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidArgument(f"{param}.function.parameters", "must be a JSON Schema object")
    return {
        "name": function["name"],
        "description": str(function.get("description") or ""),
        "parameters": parameters,
    }


def _samples(
    kind: Kind,
    prompts: Sequence[PromptInput],
    body: schemas.GenerationFields,
    options: dict[str, Any],
    headers: DoorHeaders,
    max_tokens_param: str,
) -> tuple[list[gateway_pb2.GenerateRequest], list[int]]:
    """n requests per prompt; sample i of a seeded request uses seed + i (reproducible)."""
    requests, prompt_of = [], []
    for p, prompt in enumerate(prompts):
        for i in range(body.n):
            key = headers.idempotency_key
            if key and (len(prompts) > 1 or body.n > 1):
                key = f"{key}:{p}:{i}"
            seed = None if body.seed is None else body.seed + i
            try:
                request = build_request(prompt, seed=seed, idempotency_key=key, **options)
            except InvalidArgument as error:
                field = error.field or "request"
                raise InvalidArgument(
                    openai_param(kind, max_tokens_param, field),
                    error.message.removeprefix(f"{field}: "),
                ) from None
            requests.append(request)
            prompt_of.append(p)
    return requests, prompt_of


def chat_plan(body: schemas.ChatCompletionRequest, headers: DoorHeaders) -> Plan:
    refuse_unsupported(body)
    if not body.messages:
        raise InvalidArgument("messages", "must hold at least one message")
    messages = [_chat_message(index, message) for index, message in enumerate(body.messages)]
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = body.max_completion_tokens or body.max_tokens
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidArgument("top_logprobs", "needs logprobs: true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    tool_options, tool_answer = _tool_options(body)
    options = _generation_options(body, max_tokens, logprobs) | tool_options
    requests, prompt_of = _samples("chat", [messages], body, options, headers, max_tokens_param)
    return Plan(
        "chat",
        body.model,
        requests,
        prompt_of,
        headers,
        body.stream,
        _include_usage(body),
        body.logprobs,
        max_tokens_param,
        tool_answer,
    )


def _chat_message(index: int, message: schemas.ChatMessageIn) -> dict[str, Any]:
    role = CHAT_ROLES.get(message.role)
    if role is None:
        raise InvalidArgument(
            f"messages[{index}].role",
            f"role {message.role!r} is not supported (use system, developer, user, assistant "
            "or tool)",
        )
    content = message.content
    if isinstance(content, list):
        texts = []
        for part_index, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgument(
                    f"messages[{index}].content[{part_index}]",
                    f"only text parts are supported, got type {part.get('type')!r}",
                )
            texts.append(part["text"])
        content = "".join(texts)
    turn: dict[str, Any] = {"role": role, "content": content or ""}
    if message.tool_calls:
        turn["tool_calls"] = [
            _call_in(f"messages[{index}].tool_calls[{i}]", call)
            for i, call in enumerate(message.tool_calls)
        ]
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def _call_in(param: str, call: dict[str, Any]) -> dict[str, str]:
    """An assistant turn's call, OpenAI's shape -> the SDK's (id, name, arguments_json)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidArgument(f"{param}.function.name", "must be a string")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise InvalidArgument(f"{param}.function.arguments", "must be JSON text (a string)")
    return {"id": str(call.get("id", "")), "name": function["name"], "arguments_json": arguments}


def completion_plan(
    body: schemas.CompletionRequest, headers: DoorHeaders, max_prompts: int
) -> Plan:
    refuse_unsupported(body)
    for name in ("tools", "tool_choice"):
        if _is_set(getattr(body, name)) and getattr(body, name) != "none":
            raise InvalidArgument(name, "tool calling needs chat: use /v1/chat/completions")
    if body.echo:
        raise InvalidArgument("echo", "kvmesh does not return the prompt; echo must be false")
    prompts = _prompts(body.prompt)
    if len(prompts) > max_prompts:
        raise InvalidArgument("prompt", f"at most {max_prompts} prompts per request")
    options = _generation_options(body, body.max_tokens, body.logprobs)
    requests, prompt_of = _samples("completion", prompts, body, options, headers, "max_tokens")
    return Plan(
        "completion",
        body.model,
        requests,
        prompt_of,
        headers,
        body.stream,
        _include_usage(body),
        body.logprobs is not None,
        "max_tokens",
    )


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptInput]:
    """A string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidArgument("prompt", "must not be empty")
    if all(isinstance(item, int) for item in prompt):
        _check_ids(prompt, "prompt")  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]
    for index, item in enumerate(prompt):
        if isinstance(item, list):
            if not item:
                raise InvalidArgument(f"prompt[{index}]", "must not be empty")
            _check_ids(item, f"prompt[{index}]")
    return list(prompt)  # type: ignore[arg-type]


def _check_ids(ids: list[int], param: str) -> None:
    """Token ids must fit the wire's uint32 (the gateway checks them against the vocabulary)."""
    for index, token in enumerate(ids):
        if not 0 <= token <= UINT32_MAX:
            raise InvalidArgument(f"{param}[{index}]", f"token id {token} is not a valid id")


def _include_usage(body: schemas.GenerationFields) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


# --- errors ----------------------------------------------------------------------------------

_LABEL_FIELD = re.compile(r"^labels\[(?P<key>.*)\]$")


def openai_param(kind: Kind, max_tokens_param: str, gateway_field: str) -> str:
    """The request's own name for a field the gateway named (e.g. sampling.top_p -> top_p)."""
    if gateway_field.startswith("prompt.chat.tool"):
        return _tool_param(gateway_field.removeprefix("prompt.chat."))
    if gateway_field in ("sampling.json_schema", "sampling.json_object"):
        return "response_format"
    if gateway_field.startswith("prompt"):
        if kind == "completion":
            rest = gateway_field.removeprefix("prompt").removeprefix(".text")
            return "prompt" + rest.removeprefix(".token_ids").removeprefix(".ids")
        return "messages" + gateway_field.removeprefix("prompt").removeprefix(".chat").removeprefix(
            ".messages"
        )
    if gateway_field == "sampling.max_tokens":
        return max_tokens_param
    if gateway_field == "sampling.logprobs":
        return "top_logprobs" if kind == "chat" else "logprobs"
    if gateway_field.startswith("sampling."):
        return gateway_field.removeprefix("sampling.")
    if gateway_field == "idempotency_key":
        return "Idempotency-Key"
    label = _LABEL_FIELD.match(gateway_field)
    if gateway_field == "labels" or label:
        return "user" if label and label["key"] == "user" else "metadata"
    return gateway_field


def _tool_param(field: str) -> str:
    """tools[1].name -> tools[1].function.name; tool_choice.name -> tool_choice."""
    if field.startswith("tool_choice"):
        return "tool_choice"
    head, dot, rest = field.partition("].")
    if not dot:
        return field
    leaf = "parameters" if rest == "parameters_json_schema" else rest
    return f"{head}].function.{leaf}"


@dataclass(slots=True, frozen=True)
class HttpError:
    """An error as the door answers it: status, OpenAI error body, extra headers."""

    status: int
    body: schemas.ErrorBody
    headers: dict[str, str]


_STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}


def http_error(error: KvmeshError, plan: Plan | None = None) -> HttpError:
    """The HTTP status and OpenAI error body of a kvmesh error (500 only for a bug)."""
    status, kind = _STATUS.get(error.status, (500, "server_error"))
    param = error.field
    message = error.message
    code: str | None = None
    if param is not None and plan is not None:
        param = openai_param(plan.kind, plan.max_tokens_param, param)
        message = f"{param}: {message.removeprefix(f'{error.field}: ')}"
    if param == "model" and status == 400 and "unknown model" in message:
        status, kind, code = 404, "not_found_error", "model_not_found"
    headers: dict[str, str] = {}
    if error.retry_after_s is not None:
        headers["retry-after"] = str(max(1, math.ceil(error.retry_after_s)))
        headers["retry-after-ms"] = str(max(1, round(error.retry_after_s * 1000)))
    if status == 429:
        code = "rate_limit_exceeded"
    detail = schemas.ErrorDetail(message=message, type=kind, param=param, code=code)
    return HttpError(status, schemas.ErrorBody(error=detail), headers)


# --- answers ---------------------------------------------------------------------------------


def finish_reason(kvmesh_reason: str) -> str:
    return FINISH_REASONS.get(kvmesh_reason, "stop")


def token_name(token_id: int) -> str:
    """How a token is named in logprobs: the door holds no tokenizer, so by its id (the way
    vLLM's --return-tokens-as-token-ids names them)."""
    return f"token_id:{token_id}"


def chat_logprobs(entries: Sequence[TokenLogprob]) -> schemas.ChatLogprobs:
    return schemas.ChatLogprobs(
        content=[
            schemas.ChatTokenLogprob(
                token=token_name(e.token_id),
                logprob=e.logprob,
                top_logprobs=[
                    schemas.TopLogprob(token=token_name(t), logprob=lp) for t, lp in e.top
                ],
            )
            for e in entries
        ]
    )


def completion_logprobs(
    entries: Sequence[TokenLogprob], text_offset: Sequence[int]
) -> schemas.CompletionLogprobs:
    return schemas.CompletionLogprobs(
        tokens=[token_name(e.token_id) for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{token_name(t): lp for t, lp in e.top} for e in entries],
        text_offset=list(text_offset),
    )


def chunk_offsets(start: int, count: int) -> list[int]:
    """Text offsets of `count` tokens that arrived in one chunk starting at `start`: the door
    sees the chunk's text, not each token's, so every token of a chunk gets the chunk's start."""
    return [start] * count


def usage(plan: Plan, results: Sequence[GenerationResult]) -> schemas.Usage:
    """OpenAI counts each prompt once, however many samples; cost and completions are summed."""
    firsts = [r for i, r in enumerate(results) if plan.first_of_prompt(i)]
    prompt_tokens = sum(r.usage.prompt_tokens for r in firsts)
    completion_tokens = sum(r.usage.completion_tokens for r in results)
    return schemas.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=schemas.PromptTokensDetails(
            cached_tokens=sum(r.usage.cached_prompt_tokens for r in firsts)
        ),
        cost_usd=sum(r.usage.cost_usd for r in results),
        response_cache_hit=all(r.usage.response_cache_hit for r in results),
    )


def kvmesh_info(plan: Plan, results: Sequence[GenerationResult]) -> schemas.KvmeshInfo:
    return schemas.KvmeshInfo(
        requested_model=plan.requested_model,
        fallback=any(r.fallback for r in results),
        request_ids=[r.request_id for r in results],
    )


def response_id(plan: Plan, request_id: str) -> str:
    return f"{'chatcmpl' if plan.kind == 'chat' else 'cmpl'}-{request_id}"


def answer_content(plan: Plan, result: GenerationResult) -> str | None:
    """The text of an answer that is content: all of it, the free text before an auto call,
    or none for a call (an answer cut short before its call parsed keeps its text)."""
    if not result.tool_calls:
        return result.text
    if plan.tool_answer == "auto":
        return split_answer(result.text)[0] or None
    return None


def tool_calls(result: GenerationResult) -> list[schemas.ToolCall]:
    return [
        schemas.ToolCall(
            id=call.id, function=schemas.FunctionCall(name=call.name, arguments=call.arguments_json)
        )
        for call in result.tool_calls
    ]


def chat_message(plan: Plan, result: GenerationResult) -> schemas.ChatMessageOut:
    calls = tool_calls(result)
    return schemas.ChatMessageOut(content=answer_content(plan, result), tool_calls=calls or None)


def whole_response(
    plan: Plan, results: Sequence[GenerationResult], offsets: Sequence[Sequence[int]]
) -> schemas.ChatCompletion | schemas.Completion:
    """The non-streamed body: a chat completion or a completion, one choice per result.

    `offsets` are each choice's token text offsets (completions' logprobs)."""
    common: dict[str, Any] = {
        "id": response_id(plan, results[0].request_id),
        "created": plan.created,
        "model": results[0].model,
        "usage": usage(plan, results),
        "kvmesh": kvmesh_info(plan, results),
    }
    reasons = [(finish_reason(r.finish_reason), r.finish_reason) for r in results]
    if plan.kind == "chat":
        return schemas.ChatCompletion(
            **common,
            choices=[
                schemas.ChatChoice(
                    index=index,
                    message=chat_message(plan, result),
                    logprobs=chat_logprobs(result.logprobs) if plan.logprobs else None,
                    finish_reason=reasons[index][0],
                    kvmesh_finish_reason=reasons[index][1],
                )
                for index, result in enumerate(results)
            ],
        )
    return schemas.Completion(
        **common,
        choices=[
            schemas.CompletionChoice(
                index=index,
                text=result.text,
                logprobs=(
                    completion_logprobs(result.logprobs, offsets[index]) if plan.logprobs else None
                ),
                finish_reason=reasons[index][0],
                kvmesh_finish_reason=reasons[index][1],
            )
            for index, result in enumerate(results)
        ],
    )
