"""Protobuf <-> engine conversions of the worker."""

from __future__ import annotations

import time

import pytest

from kvmesh.contracts.constraints import Constraint, ConstraintKind
from kvmesh.errors import InvalidArgument
from kvmesh.v1 import common_pb2
from services.worker.convert import (
    DEADLINE_MARGIN_S,
    engine_request,
    finished,
    sampling_params,
    token_chunk,
)
from services.worker.engine.api import (
    FinishReason,
    Priority,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)


def test_unset_sampling_fields_keep_engine_defaults() -> None:
    assert sampling_params(common_pb2.SamplingParams()) == SamplingParams()
    params = sampling_params(
        common_pb2.SamplingParams(
            max_tokens=5, temperature=0.5, top_k=3, top_p=0.9, seed=7, stop=["x"], logprobs=2
        )
    )
    assert (params.max_tokens, params.top_k, params.seed, params.stop) == (5, 3, 7, ("x",))
    assert params.temperature == pytest.approx(0.5) and params.logprobs == 2


def test_invalid_sampling_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="max_tokens"):
        sampling_params(common_pb2.SamplingParams(max_tokens=0))
    with pytest.raises(InvalidArgument) as refused:
        sampling_params(common_pb2.SamplingParams(regex=""))
    assert refused.value.field == "sampling.regex"


def test_constraint_reaches_the_engine_unchanged() -> None:
    params = sampling_params(common_pb2.SamplingParams(json_schema='{"type": "object"}'))
    assert params.constraint == Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "object"}')


def test_engine_request_deadline_and_priority() -> None:
    proto = common_pb2.InferenceRequest(
        request_id="r", prompt_token_ids=[1, 2], priority=common_pb2.PRIORITY_BATCH, cache_salt=b"s"
    )
    before = time.monotonic()
    request = engine_request(proto, time_remaining=2.0)
    assert request.priority is Priority.BATCH and request.cache_salt == b"s"
    assert request.deadline is not None
    assert before + 2.0 - DEADLINE_MARGIN_S <= request.deadline <= time.monotonic() + 2.0
    assert engine_request(proto, None).deadline is None
    with pytest.raises(InvalidArgument, match="prompt_token_ids"):
        engine_request(common_pb2.InferenceRequest(), None)


def _output(tokens: list[int], text: str, reason: FinishReason | None = None) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        new_token_ids=tokens,
        text_delta=text,
        logprobs=[TokenLogprob(t, -1.0, [(t, -1.0)]) for t in tokens],
        finish_reason=reason,
        num_prompt_tokens=4,
        num_cached_prompt_tokens=2,
        num_output_tokens=3,
    )


def test_token_chunk_joins_outputs() -> None:
    chunk = token_chunk([_output([1], "a"), _output([2, 3], "bc")])
    assert list(chunk.token_ids) == [1, 2, 3] and chunk.text == "abc"
    assert [lp.token_id for lp in chunk.logprobs] == [1, 2, 3]


def test_finished_carries_usage_and_error() -> None:
    last = _output([], "", FinishReason.ERROR)
    last.error = "boom"
    event = finished(last, timings=common_pb2.Timings(kv_transfer_ms=3.0))
    assert event.finish_reason == common_pb2.FINISH_REASON_ERROR
    assert event.error_message == "boom"
    assert (event.usage.prompt_tokens, event.usage.cached_prompt_tokens) == (4, 2)
    assert event.usage.completion_tokens == 3 and event.timings.kv_transfer_ms == 3.0
