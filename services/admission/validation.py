"""Checks a GenerateRequest before it costs anything; every error names the field.

Invalid UTF-8 never reaches these checks: protobuf refuses it while parsing, and the servicer
reports that as INVALID_ARGUMENT on the whole request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jinja2

from kvmesh.errors import InvalidArgument
from kvmesh.v1 import common_pb2, gateway_pb2
from services.admission.catalog import ModelSpec, TokenizerLike
from services.admission.tenants import PriorityClass

CHAT_ROLES = frozenset({"system", "user", "assistant"})
MAX_CHAT_MESSAGES = 512
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 10.0
MAX_LABELS = 32
MAX_LABEL_KEY_CHARS = 64
MAX_LABEL_VALUE_CHARS = 256
MAX_ID_CHARS = 128
MAX_MODEL_CHARS = 128

_PRIORITIES = {
    common_pb2.PRIORITY_UNSPECIFIED: None,
    common_pb2.PRIORITY_INTERACTIVE: PriorityClass.INTERACTIVE,
    common_pb2.PRIORITY_BATCH: PriorityClass.BATCH,
}


@dataclass(slots=True, frozen=True)
class RequestLimits:
    """Gateway-wide bounds on a request."""

    default_max_tokens: int = 256
    max_tokens_limit: int = 4096
    max_stop_strings: int = 8


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
    if len(request.labels) > MAX_LABELS:
        raise InvalidArgument("labels", f"at most {MAX_LABELS} labels")
    for key, value in request.labels.items():
        if not key or len(key) > MAX_LABEL_KEY_CHARS:
            raise InvalidArgument("labels", f"keys must be 1-{MAX_LABEL_KEY_CHARS} characters")
        if len(value) > MAX_LABEL_VALUE_CHARS:
            raise InvalidArgument(
                f"labels[{key}]", f"values must be at most {MAX_LABEL_VALUE_CHARS} characters"
            )
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
    prompt: common_pb2.Prompt, tokenizer: TokenizerLike, model: ModelSpec
) -> list[int]:
    """The prompt as token ids: text encoded, chat rendered with the template, ids checked."""
    kind = prompt.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("prompt", "missing: set text, chat or token_ids")
    if kind == "text":
        if not prompt.text:
            raise InvalidArgument("prompt.text", "empty prompt")
        ids = tokenizer.encode(prompt.text)
    elif kind == "chat":
        messages = _chat_messages(prompt.chat)
        try:
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=prompt.chat.add_generation_prompt
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


def _chat_messages(chat: common_pb2.ChatMessages) -> list[dict[str, str]]:
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
    if not any(m.content for m in chat.messages):
        raise InvalidArgument("prompt.chat.messages", "every message is empty")
    return [{"role": m.role, "content": m.content} for m in chat.messages]


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
    if sampling.HasField("temperature") and not (
        math.isfinite(sampling.temperature) and 0.0 <= sampling.temperature <= MAX_TEMPERATURE
    ):
        raise InvalidArgument("sampling.temperature", f"must be between 0 and {MAX_TEMPERATURE}")
    if sampling.HasField("top_p") and not (
        math.isfinite(sampling.top_p) and 0.0 < sampling.top_p <= 1.0
    ):
        raise InvalidArgument("sampling.top_p", "must be in (0, 1]")
    if sampling.top_k > vocab_size:
        raise InvalidArgument("sampling.top_k", f"must be at most the vocabulary size {vocab_size}")
    if sampling.HasField("logprobs") and sampling.logprobs > MAX_LOGPROBS:
        raise InvalidArgument("sampling.logprobs", f"at most {MAX_LOGPROBS}")
    _check_stops(sampling, vocab_size, limits)
    return checked


def _check_stops(
    sampling: common_pb2.SamplingParams, vocab_size: int, limits: RequestLimits
) -> None:
    if len(sampling.stop) > limits.max_stop_strings:
        raise InvalidArgument("sampling.stop", f"at most {limits.max_stop_strings} stop strings")
    for index, stop in enumerate(sampling.stop):
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise InvalidArgument(
                f"sampling.stop[{index}]", f"stop strings must be 1-{MAX_STOP_CHARS} characters"
            )
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument("sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
    for index, token in enumerate(sampling.stop_token_ids):
        if token >= vocab_size:
            raise InvalidArgument(
                f"sampling.stop_token_ids[{index}]",
                f"token id {token} is outside the vocabulary (size {vocab_size})",
            )
