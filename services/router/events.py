"""The events the router sends its caller, built from the workers' and its own view.

Started's placement (also recorded on the router's span), chunks merged, and the Finished
events: the worker's with the router's usage and timings, or the router's own when the caller
cancelled or the deadline passed mid-stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace

from kvmesh.timings import request_timings
from kvmesh.v1 import common_pb2
from services.router.placement import Plan


@dataclass(slots=True)
class Usage:
    """Tokens the caller has received so far."""

    prompt_tokens: int
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0

    def describe(self) -> str:
        return (
            f"usage so far: prompt_tokens={self.prompt_tokens} "
            f"cached_prompt_tokens={self.cached_prompt_tokens} "
            f"completion_tokens={self.completion_tokens}"
        )


def merge_chunks(events: list[common_pb2.GenerateEvent]) -> list[common_pb2.GenerateEvent]:
    """Consecutive chunks become one (the caller gets everything ready in one message)."""
    merged: list[common_pb2.GenerateEvent] = []
    for event in events:
        if (
            event.WhichOneof("event") == "chunk"
            and merged
            and merged[-1].WhichOneof("event") == "chunk"
        ):
            target = merged[-1].chunk
            target.token_ids.extend(event.chunk.token_ids)
            target.text += event.chunk.text
            target.logprobs.extend(event.chunk.logprobs)
        else:
            copy = common_pb2.GenerateEvent()
            copy.CopyFrom(event)
            merged.append(copy)
    return merged


def placement(plan: Plan, attempts: int) -> common_pb2.Placement:
    return common_pb2.Placement(
        tier=plan.tier,
        prefill_worker=plan.prefill.address,
        decode_worker=(plan.decode or plan.prefill).address,
        reason=plan.reason,
        fallback=plan.fallback,
        expected_prefix_hit_tokens=plan.expected_prefix_hit_tokens,
        attempts=attempts,
    )


def record_placement(span: trace.Span, plan: Plan, attempts: int) -> None:
    span.set_attributes(
        {
            "kvmesh.placement.tier": plan.tier,
            "kvmesh.placement.mode": "colocated" if plan.colocated else "split",
            "kvmesh.placement.prefill_worker": plan.prefill.address,
            "kvmesh.placement.decode_worker": (plan.decode or plan.prefill).address,
            "kvmesh.placement.reason": plan.reason,
            "kvmesh.placement.fallback": plan.fallback,
            "kvmesh.placement.attempts": attempts,
            "kvmesh.placement.expected_prefix_hit_tokens": plan.expected_prefix_hit_tokens,
        }
    )


def _timings(
    arrived: float, first_token_at: float | None, kv_transfer_ms: float = 0.0
) -> common_pb2.Timings:
    return request_timings(arrived, first_token_at, kv_transfer_ms=kv_transfer_ms)


def finished(
    worker_finished: common_pb2.Finished,
    plan: Plan,
    cached_prompt_tokens: int,
    usage: Usage,
    arrived: float,
    first_token_at: float | None,
) -> common_pb2.GenerateEvent:
    """The worker's Finished with the router's view: prefill's cache hits, end-to-end times."""
    merged = common_pb2.Finished()
    merged.CopyFrom(worker_finished)
    merged.usage.prompt_tokens = usage.prompt_tokens
    if not plan.colocated:
        merged.usage.cached_prompt_tokens = cached_prompt_tokens
    merged.timings.CopyFrom(
        _timings(arrived, first_token_at, worker_finished.timings.kv_transfer_ms)
    )
    span = trace.get_current_span()
    span.set_attributes(
        {
            "gen_ai.usage.input_tokens": merged.usage.prompt_tokens,
            "gen_ai.usage.output_tokens": merged.usage.completion_tokens,
            "gen_ai.response.finish_reasons": [common_pb2.FinishReason.Name(merged.finish_reason)],
            "kvmesh.prefix_hit_tokens": merged.usage.cached_prompt_tokens,
            "kvmesh.kv_transfer_ms": merged.timings.kv_transfer_ms,
        }
    )
    return common_pb2.GenerateEvent(finished=merged)


def _partial(
    reason: common_pb2.FinishReason.ValueType,
    usage: Usage,
    arrived: float,
    first_token_at: float | None,
) -> common_pb2.GenerateEvent:
    return common_pb2.GenerateEvent(
        finished=common_pb2.Finished(
            finish_reason=reason,
            usage=common_pb2.Usage(
                prompt_tokens=usage.prompt_tokens,
                cached_prompt_tokens=usage.cached_prompt_tokens,
                completion_tokens=usage.completion_tokens,
            ),
            timings=_timings(arrived, first_token_at),
        )
    )


def aborted(
    usage: Usage, arrived: float, first_token_at: float | None = None
) -> common_pb2.GenerateEvent:
    """Finished(ABORT) for a request the caller cancelled."""
    return _partial(common_pb2.FINISH_REASON_ABORT, usage, arrived, first_token_at)


def deadline(
    usage: Usage, arrived: float, first_token_at: float | None
) -> common_pb2.GenerateEvent:
    """Finished(DEADLINE) with the partial output's usage."""
    return _partial(common_pb2.FINISH_REASON_DEADLINE, usage, arrived, first_token_at)


def started(request_id: str, plan: Plan, attempts: int) -> common_pb2.GenerateEvent:
    """Started: where the request runs (the first placement, even if a hand-off resumes)."""
    return common_pb2.GenerateEvent(
        started=common_pb2.Started(
            request_id=request_id, model=plan.tier, placement=placement(plan, attempts)
        )
    )
