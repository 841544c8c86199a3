"""Checks a GenerateRequest before it costs anything; every error names the field.

Invalid UTF-8 never reaches these checks: protobuf refuses it while parsing, and the servicer
reports that as INVALID_ARGUMENT on the whole request.
"""

from __future__ import annotations

from dataclasses import dataclass

import jinja2

from kvmesh.contracts.sampling import DEFAULT_MAX_TOKENS
from kvmesh.errors import InvalidArgument
from kvmesh.request_limits import (
    MAX_ID_CHARS,
    MAX_MODEL_CHARS,
    MAX_OUTPUT_TOKENS,
    MAX_STOP_STRINGS,
    check_labels,
    check_sampling,
)
from kvmesh.tenants import PriorityClass
from kvmesh.v1 import common_pb2, gateway_pb2
from services.admission.catalog import ModelSpec, TokenizerLike
from services.admission.tool_calls import ToolPlan, chat_turns, renders_natively

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_CHAT_MESSAGES = 512

_PRIORITIES = {
    common_pb2.PRIORITY_UNSPECIFIED: None,
    common_pb2.PRIORITY_INTERACTIVE: PriorityClass.INTERACTIVE,
    common_pb2.PRIORITY_BATCH: PriorityClass.BATCH,
}


@dataclass(slots=True, frozen=True)
class RequestLimits:
    """Gateway-wide bounds on a request, within the mesh's (kvmesh/request_limits.py)."""

    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_tokens_limit: int = 4096
    max_stop_strings: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens_limit <= MAX_OUTPUT_TOKENS:
            raise ValueError(f"max_tokens_limit must be in [1, {MAX_OUTPUT_TOKENS}]")
        if not 0 <= self.max_stop_strings <= MAX_STOP_STRINGS:
            raise ValueError(f"max_stop_strings must be in [0, {MAX_STOP_STRINGS}]")


@dataclass(slots=True, frozen=True)
class Envelope:
    """The parts of a request checked before its model is known."""

    priority: PriorityClass | None
    """None when the request left it unset (the tenant's highest class applies)."""
    cache_policy: int
    """A CachePolicy value, UNSPECIFIED turned into USE."""


def check_envelope(request: gateway_pb2.GenerateRequest) -> Envelope:
    """Checks ids, labels, model name, priority and cache policy."""
    _check_short_text(request.request_id, "request_id", MAX_ID_CHARS)
    _check_short_text(request.idempotency_key, "idempotency_key", MAX_ID_CHARS * 2)
    _check_short_text(request.model, "model", MAX_MODEL_CHARS)
    check_labels(request.labels)
    if request.priority not in _PRIORITIES:
        raise InvalidArgument("priority", f"unknown priority {request.priority}")
    if request.cache_policy not in common_pb2.CachePolicy.values():
        raise InvalidArgument("cache_policy", f"unknown cache policy {request.cache_policy}")
    policy = request.cache_policy or common_pb2.CACHE_POLICY_USE
    return Envelope(priority=_PRIORITIES[request.priority], cache_policy=policy)


def _check_short_text(value: str, field: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidArgument(field, f"at most {limit} characters")
    if any(not ch.isprintable() for ch in value):
        raise InvalidArgument(field, "must contain printable characters only")


def prompt_token_ids(
    prompt: common_pb2.Prompt,
    tokenizer: TokenizerLike,
    model: ModelSpec,
    tools: ToolPlan | None = None,
) -> list[int]:
    """The prompt as token ids: text encoded, chat rendered with the template, ids checked."""
    kind = prompt.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("prompt", "missing: set text, chat or token_ids")
    _check_prompt_size(prompt, tokenizer, model)
    if kind == "text":
        if not prompt.text:
            raise InvalidArgument("prompt.text", "empty prompt")
        ids = tokenizer.encode(prompt.text)
    elif kind == "chat":
        _check_chat(prompt.chat)
        native = renders_natively(tools, tokenizer.chat_template)
        messages = chat_turns(prompt.chat, tools, native)
        try:
            ids = tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=prompt.chat.add_generation_prompt,
                tools=tools.tools if tools is not None and native else None,
            )
        except (ValueError, jinja2.TemplateError) as error:
            # No template, or the template refused the conversation (raise_exception).
            raise InvalidArgument(
                "prompt.chat", f"cannot apply the chat template: {error}"
            ) from None
    else:
        ids = list(prompt.token_ids.ids)
        if not ids:
            raise InvalidArgument("prompt.token_ids", "empty prompt")
        for index, token in enumerate(ids):
            if token >= tokenizer.vocab_size:
                raise InvalidArgument(
                    f"prompt.token_ids.ids[{index}]",
                    f"token id {token} is outside the vocabulary of {model.id!r} "
                    f"(size {tokenizer.vocab_size})",
                )
    if not ids:
        raise InvalidArgument("prompt", "the prompt encodes to no tokens")
    if len(ids) >= model.context_length:
        raise InvalidArgument(
            "prompt",
            f"the prompt is {len(ids)} tokens; model {model.id!r} takes at most "
            f"{model.context_length} tokens of prompt and output together",
        )
    return ids


def prompt_chars(prompt: common_pb2.Prompt) -> int:
    """Characters of a text or chat prompt's text (0 for token ids)."""
    if prompt.WhichOneof("input") == "text":
        return len(prompt.text)
    if prompt.WhichOneof("input") == "chat":
        return sum(len(m.content) for m in prompt.chat.messages)
    return 0


def _check_prompt_size(
    prompt: common_pb2.Prompt, tokenizer: TokenizerLike, model: ModelSpec
) -> None:
    """Refuses, before any tokenizing, a text too long for the context whatever its tokens:
    more characters than the context times the longest token's (a chat template only adds)."""
    chars = prompt_chars(prompt)
    most = model.context_length * tokenizer.max_token_chars
    if chars > most:
        raise InvalidArgument(
            "prompt",
            f"the prompt is {chars} characters; model {model.id!r} takes at most "
            f"{model.context_length} tokens of at most {tokenizer.max_token_chars} characters "
            f"each ({most} characters)",
        )


def _check_chat(chat: common_pb2.ChatMessages) -> None:
    if not chat.messages:
        raise InvalidArgument("prompt.chat.messages", "empty conversation")
    if len(chat.messages) > MAX_CHAT_MESSAGES:
        raise InvalidArgument("prompt.chat.messages", f"at most {MAX_CHAT_MESSAGES} messages")
    for index, message in enumerate(chat.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"prompt.chat.messages[{index}].role",
                f"unknown role {message.role!r} (expected one of {', '.join(sorted(CHAT_ROLES))})",
            )
    if not any(m.content or m.tool_calls for m in chat.messages):
        raise InvalidArgument("prompt.chat.messages", "every message is empty")


def checked_sampling(
    sampling: common_pb2.SamplingParams,
    *,
    prompt_tokens: int,
    model: ModelSpec,
    vocab_size: int,
    limits: RequestLimits,
) -> common_pb2.SamplingParams:
    """A copy of `sampling` with every field checked and max_tokens always set."""
    checked = common_pb2.SamplingParams()
    checked.CopyFrom(sampling)
    room = model.context_length - prompt_tokens
    if sampling.HasField("max_tokens"):
        if not 1 <= sampling.max_tokens <= limits.max_tokens_limit:
            raise InvalidArgument(
                "sampling.max_tokens", f"must be between 1 and {limits.max_tokens_limit}"
            )
        if sampling.max_tokens > room:
            raise InvalidArgument(
                "sampling.max_tokens",
                f"prompt ({prompt_tokens}) + max_tokens ({sampling.max_tokens}) exceeds the "
                f"context of {model.id!r} ({model.context_length} tokens)",
            )
    else:
        checked.max_tokens = min(limits.default_max_tokens, room)
    if sampling.top_k > vocab_size:
        raise InvalidArgument("sampling.top_k", f"must be at most the vocabulary size {vocab_size}")
    check_sampling(sampling, limits.max_stop_strings)
    for index, token in enumerate(sampling.stop_token_ids):
        if token >= vocab_size:
            raise InvalidArgument(
                f"sampling.stop_token_ids[{index}]",
                f"token id {token} is outside the vocabulary (size {vocab_size})",
            )
    return checked
