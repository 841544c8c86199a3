"""Protobuf <-> engine types for the worker service (the engine never sees protobuf)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvmesh.contracts.constraints import checked_constraint
from kvmesh.errors import InvalidArgument
from kvmesh.request_limits import check_inference_request
from kvmesh.v1 import common_pb2
from services.worker.engine.api import (
    EngineRequest,
    FinishReason,
    Priority,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)

if TYPE_CHECKING:
    from services.worker.engine.api import KvLayout

DEADLINE_MARGIN_S = 0.05
"""The engine stops this long before the gRPC deadline, so its partial output still arrives."""

FINISH_REASONS: dict[FinishReason, common_pb2.FinishReason.ValueType] = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.DEADLINE: common_pb2.FINISH_REASON_DEADLINE,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}


def sampling_params(proto: common_pb2.SamplingParams) -> SamplingParams:
    """Engine sampling parameters; unset optional fields keep the engine defaults."""
    params = SamplingParams(
        stop=tuple(proto.stop),
        stop_token_ids=tuple(proto.stop_token_ids),
        ignore_eos=proto.ignore_eos,
        constraint=checked_constraint(proto),
    )
    if proto.HasField("max_tokens"):
        params.max_tokens = proto.max_tokens
    if proto.HasField("temperature"):
        params.temperature = proto.temperature
    if proto.HasField("top_k"):
        params.top_k = proto.top_k
    if proto.HasField("top_p"):
        params.top_p = proto.top_p
    if proto.HasField("seed"):
        params.seed = proto.seed
    if proto.HasField("logprobs"):
        params.logprobs = proto.logprobs
    try:
        params.validate()
    except ValueError as error:
        raise InvalidArgument("sampling", str(error)) from None
    return params


def engine_request(
    proto: common_pb2.InferenceRequest, time_remaining: float | None
) -> EngineRequest:
    """The engine's request, once `proto` is within the mesh's bounds; `time_remaining` is
    the RPC's (None: no deadline)."""
    check_inference_request(proto)
    if not proto.prompt_token_ids:
        raise InvalidArgument("prompt_token_ids", "must not be empty")
    deadline = None
    if time_remaining is not None:
        deadline = time.monotonic() + max(time_remaining - DEADLINE_MARGIN_S, 0.0)
    return EngineRequest(
        request_id=proto.request_id or uuid.uuid4().hex,
        prompt_token_ids=list(proto.prompt_token_ids),
        sampling=sampling_params(proto.sampling),
        priority=Priority.BATCH
        if proto.priority == common_pb2.PRIORITY_BATCH
        else Priority.INTERACTIVE,
        cache_salt=proto.cache_salt,
        deadline=deadline,
    )


def _logprob(entry: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=entry.token_id,
        logprob=entry.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top],
    )


def token_chunk(outputs: Sequence[RequestOutput]) -> common_pb2.TokenChunk:
    """One chunk carrying the tokens, text and logprobs of several consecutive outputs."""
    chunk = common_pb2.TokenChunk()
    for output in outputs:
        chunk.token_ids.extend(output.new_token_ids)
        chunk.text += output.text_delta
        if output.logprobs:
            chunk.logprobs.extend(_logprob(entry) for entry in output.logprobs)
    return chunk


def sampled_chunk(output: RequestOutput) -> common_pb2.TokenChunk:
    """PrefillResponse.sampled: the one token a prefill sampled, its logprob when asked for;
    empty when the request ended before its prompt ran (its deadline passed while it waited
    or mid-prompt, or the engine aborted it)."""
    if output.sampled_token_id is None:
        return common_pb2.TokenChunk()
    chunk = common_pb2.TokenChunk(token_ids=[output.sampled_token_id])
    if output.sampled_logprob is not None:
        chunk.logprobs.append(_logprob(output.sampled_logprob))
    return chunk


def sampled_token(chunk: common_pb2.TokenChunk) -> tuple[int, TokenLogprob | None]:
    """DecodeRequest.sampled as the engine's first token id and logprob."""
    if len(chunk.token_ids) != 1 or len(chunk.logprobs) > 1:
        raise InvalidArgument("sampled", "must carry exactly the one token prefill sampled")
    if not chunk.logprobs:
        return chunk.token_ids[0], None
    entry = chunk.logprobs[0]
    top = [(t.token_id, t.logprob) for t in entry.top]
    return chunk.token_ids[0], TokenLogprob(entry.token_id, entry.logprob, top)


def finish_reason(reason: FinishReason) -> common_pb2.FinishReason.ValueType:
    return FINISH_REASONS[reason]


def finished(
    last: RequestOutput,
    *,
    cached_prompt_tokens: int | None = None,
    timings: common_pb2.Timings | None = None,
) -> common_pb2.Finished:
    """The Finished event of a request from its last output."""
    reason = last.finish_reason or FinishReason.ABORT
    return common_pb2.Finished(
        finish_reason=finish_reason(reason),
        usage=common_pb2.Usage(
            prompt_tokens=last.num_prompt_tokens,
            cached_prompt_tokens=last.num_cached_prompt_tokens
            if cached_prompt_tokens is None
            else cached_prompt_tokens,
            completion_tokens=last.num_output_tokens,
        ),
        timings=timings,
        error_message=last.error or "",
    )


def layout_proto(layout: KvLayout) -> common_pb2.KvLayout:
    """The wire form of the engine's KV layout."""
    return common_pb2.KvLayout(
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        engine=layout.engine,
        format_version=layout.format_version,
    )
