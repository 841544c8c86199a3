"""The bounds on a request that every service checks, from this one definition.

The gateway checks a client's request against them (and against what only it knows: the
model's vocabulary and context, the tenant's limits); the router and every worker check the
InferenceRequest they are sent against them again, so a caller that skips the gateway (or a
mesh member gone wrong) cannot hand a service 30,000 stop strings or 100,000 labels. Each
refusal is an InvalidArgument naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from kvmesh.contracts.constraints import checked_constraint
from kvmesh.contracts.sampling import MAX_LOGPROBS
from kvmesh.errors import InvalidArgument
from kvmesh.v1 import common_pb2

MAX_ID_CHARS = 128
"""Request ids and other client-chosen ids."""
MAX_MODEL_CHARS = 128
MAX_TENANT_CHARS = 256
MAX_CACHE_SALT_BYTES = 256
MAX_LABELS = 32
MAX_LABEL_KEY_CHARS = 64
MAX_LABEL_VALUE_CHARS = 256
MAX_STOP_STRINGS = 64
"""The most stop strings any service accepts (the gateway's own limit, 8 by default, may only
be lower)."""
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TEMPERATURE = 10.0
MAX_OUTPUT_TOKENS = 1 << 16
"""The most tokens any service generates for one request (the gateway's own limit and the
model's context are lower)."""
MAX_PROMPT_TOKENS = 1 << 20
"""The most prompt tokens any service accepts (the model's context is lower)."""


def check_labels(labels: Mapping[str, str]) -> None:
    """At most MAX_LABELS labels, each key and value within its length."""
    if len(labels) > MAX_LABELS:
        raise InvalidArgument("labels", f"at most {MAX_LABELS} labels")
    for key, value in labels.items():
        if not key or len(key) > MAX_LABEL_KEY_CHARS:
            raise InvalidArgument("labels", f"keys must be 1-{MAX_LABEL_KEY_CHARS} characters")
        if len(value) > MAX_LABEL_VALUE_CHARS:
            raise InvalidArgument(
                f"labels[{key}]", f"values must be at most {MAX_LABEL_VALUE_CHARS} characters"
            )


def check_stops(sampling: common_pb2.SamplingParams, max_stop_strings: int) -> None:
    """At most `max_stop_strings` stop strings of 1-MAX_STOP_CHARS characters, at most
    MAX_STOP_TOKEN_IDS stop token ids."""
    if len(sampling.stop) > max_stop_strings:
        raise InvalidArgument("sampling.stop", f"at most {max_stop_strings} stop strings")
    for index, stop in enumerate(sampling.stop):
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise InvalidArgument(
                f"sampling.stop[{index}]", f"stop strings must be 1-{MAX_STOP_CHARS} characters"
            )
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument("sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")


def check_sampling(sampling: common_pb2.SamplingParams, max_stop_strings: int) -> None:
    """The bounds of every sampling field that do not depend on the model, the output
    constraint's included (kvmesh/contracts/constraints.py)."""
    if sampling.HasField("max_tokens") and not 1 <= sampling.max_tokens <= MAX_OUTPUT_TOKENS:
        raise InvalidArgument("sampling.max_tokens", f"must be between 1 and {MAX_OUTPUT_TOKENS}")
    if sampling.HasField("temperature") and not (
        math.isfinite(sampling.temperature) and 0.0 <= sampling.temperature <= MAX_TEMPERATURE
    ):
        raise InvalidArgument("sampling.temperature", f"must be between 0 and {MAX_TEMPERATURE}")
    if sampling.HasField("top_p") and not (
        math.isfinite(sampling.top_p) and 0.0 < sampling.top_p <= 1.0
    ):
        raise InvalidArgument("sampling.top_p", "must be in (0, 1]")
    if sampling.HasField("logprobs") and sampling.logprobs > MAX_LOGPROBS:
        raise InvalidArgument("sampling.logprobs", f"at most {MAX_LOGPROBS}")
    check_stops(sampling, max_stop_strings)
    checked_constraint(sampling)


def _check_length(value: str | bytes, field: str, limit: int, unit: str) -> None:
    if len(value) > limit:
        raise InvalidArgument(field, f"at most {limit} {unit}")


def check_inference_request(request: common_pb2.InferenceRequest) -> None:
    """Every bound of an InferenceRequest that does not depend on the model (the router and
    the workers call this on what they are sent)."""
    _check_length(request.request_id, "request_id", MAX_ID_CHARS, "characters")
    _check_length(request.model, "model", MAX_MODEL_CHARS, "characters")
    _check_length(request.tenant, "tenant", MAX_TENANT_CHARS, "characters")
    _check_length(request.cache_salt, "cache_salt", MAX_CACHE_SALT_BYTES, "bytes")
    if len(request.prompt_token_ids) > MAX_PROMPT_TOKENS:
        raise InvalidArgument("prompt_token_ids", f"at most {MAX_PROMPT_TOKENS} tokens")
    if request.priority not in common_pb2.Priority.values():
        raise InvalidArgument("priority", f"unknown priority {request.priority}")
    check_labels(request.labels)
    check_sampling(request.sampling, MAX_STOP_STRINGS)
