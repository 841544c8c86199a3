"""Builders for engine-side unit tests that need request states but no model."""

from __future__ import annotations

from collections.abc import Sequence

from services.worker.engine.api import EngineRequest, Priority, SamplingParams
from services.worker.engine.output_processor import OutputProcessor
from services.worker.engine.request import RequestState


class PieceDecoder:
    """A TextDecoder whose token i decodes to pieces[i]."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = pieces

    def push(self, token_ids: Sequence[int]) -> str:
        return "".join(self.pieces[t] for t in token_ids)


def make_state(
    request_id: str,
    prompt: Sequence[int],
    *,
    arrival_seq: int = 0,
    priority: Priority = Priority.INTERACTIVE,
    cache_salt: bytes = b"",
    sampling: SamplingParams | None = None,
) -> RequestState:
    sampling = sampling or SamplingParams()
    request = EngineRequest(
        request_id, list(prompt), sampling, priority=priority, cache_salt=cache_salt
    )
    processor = OutputProcessor(sampling, PieceDecoder([""] * 1000), frozenset(), 10_000)
    return RequestState(
        request=request,
        arrival_seq=arrival_seq,
        token_ids=list(prompt),
        num_prompt_tokens=len(prompt),
        processor=processor,
    )
