"""A KvmeshError carried inside a message (GenerateMany) comes back as the same typed error."""

from __future__ import annotations

import pytest

from kvmesh.errors import (
    AlreadyExists,
    InvalidArgument,
    KvmeshError,
    QuotaViolation,
    ResourceExhausted,
    Unavailable,
)
from kvmesh.rpc_status import error_from_status, to_status_proto


@pytest.mark.parametrize(
    "error",
    [
        InvalidArgument("prompt_token_ids", "must not be empty"),
        ResourceExhausted("queue full", retry_after_s=1.5),
        ResourceExhausted(
            "over budget", quota_violations=(QuotaViolation("tenant:a", "tokens per minute"),)
        ),
        AlreadyExists("request id 'x' is already in use on this worker"),
        Unavailable("the worker ended its GenerateMany stream"),
    ],
    ids=["field", "retry", "quota", "exists", "unavailable"],
)
def test_a_status_proto_turns_back_into_the_error_it_was_made_from(error: KvmeshError) -> None:
    wire = to_status_proto(error).SerializeToString()
    back = error_from_status(type(to_status_proto(error)).FromString(wire))
    assert type(back) is type(error)
    assert (back.status, back.message, back.field) == (error.status, error.message, error.field)
    assert back.retry_after_s == error.retry_after_s
    assert back.quota_violations == error.quota_violations
