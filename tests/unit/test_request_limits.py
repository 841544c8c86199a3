"""The mesh's request bounds (kvmesh/request_limits.py), the one definition every service checks."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.request_limits import (
    MAX_LABELS,
    MAX_OUTPUT_TOKENS,
    MAX_STOP_STRINGS,
    check_inference_request,
)
from kvmesh.v1 import common_pb2


def _request(**fields: object) -> common_pb2.InferenceRequest:
    return common_pb2.InferenceRequest(prompt_token_ids=[1, 2, 3], **fields)  # type: ignore[arg-type]


def _sampling(**fields: object) -> common_pb2.InferenceRequest:
    return _request(sampling=common_pb2.SamplingParams(**fields))  # type: ignore[arg-type]


def test_a_request_within_every_bound_passes() -> None:
    check_inference_request(
        _request(
            request_id="r" * 128,
            labels={f"k{i}": "v" * 256 for i in range(MAX_LABELS)},
            sampling=common_pb2.SamplingParams(
                max_tokens=MAX_OUTPUT_TOKENS, stop=["s" * 256] * MAX_STOP_STRINGS, logprobs=20
            ),
        )
    )


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (_sampling(stop=["x"] * 30_000), "sampling.stop"),
        (_sampling(stop=[""]), "sampling.stop[0]"),
        (_sampling(stop=["x" * 257]), "sampling.stop[0]"),
        (_sampling(stop_token_ids=[1] * 65), "sampling.stop_token_ids"),
        (_sampling(max_tokens=2**32 - 1), "sampling.max_tokens"),
        (_sampling(max_tokens=0), "sampling.max_tokens"),
        (_sampling(temperature=float("nan")), "sampling.temperature"),
        (_sampling(top_p=0.0), "sampling.top_p"),
        (_sampling(logprobs=21), "sampling.logprobs"),
        (_request(labels={f"k{i}": "v" for i in range(100_000)}), "labels"),
        (_request(labels={"k": "v" * 257}), "labels[k]"),
        (_request(request_id="r" * 129), "request_id"),
        (_request(model="m" * 129), "model"),
        (_request(tenant="t" * 257), "tenant"),
        (_request(cache_salt=b"s" * 257), "cache_salt"),
        (_request(priority=7), "priority"),
    ],
)
def test_each_bound_names_its_field(request_: common_pb2.InferenceRequest, field: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        check_inference_request(request_)
    assert raised.value.field == field
