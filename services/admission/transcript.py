"""What one request produced, as it streams: the events the client saw and its final usage.

Also builds the events of the two ways an answer is given without the router: a
response-cache hit (stored tokens streamed in chunks) and an idempotent replay.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvmesh.timings import request_timings
from kvmesh.v1 import cache_pb2, common_pb2
from services.admission.catalog import TokenizerLike
from services.admission.pricing import TokenCounts

CACHE_HIT_CHUNK_TOKENS = 16
"""Tokens per chunk when a response-cache hit is streamed."""

RESULT_REASONS = frozenset(
    {
        common_pb2.FINISH_REASON_STOP,
        common_pb2.FINISH_REASON_LENGTH,
        common_pb2.FINISH_REASON_TOOL_CALLS,
    }
)
"""Finish reasons of a complete answer (cacheable, and replayed for an idempotency key)."""


@dataclass(slots=True)
class Transcript:
    """Accumulates a request's stream so its end can be metered, cached and replayed."""

    request_id: str
    model: str
    """The tier serving the request (the router's Started may name another: auto, fallback)."""
    prompt_tokens: int
    arrived: float
    """time.monotonic() when the request reached the gateway."""
    started: common_pb2.Started | None = None
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    finished: common_pb2.Finished | None = None
    queue_s: float = 0.0
    """Time spent in the admission queue."""
    response_cache_hit: bool = False

    def start(self, started: common_pb2.Started) -> common_pb2.GenerateEvent:
        """Records the Started event (the gateway's request id and model) and returns it."""
        started.request_id = self.request_id
        if started.model:
            self.model = started.model
        else:
            started.model = self.model
        self.started = started
        return common_pb2.GenerateEvent(started=started)

    def ensure_started(self) -> Iterator[common_pb2.GenerateEvent]:
        """A bare Started event when none was sent (the stream must begin with one)."""
        if self.started is None:
            yield self.start(common_pb2.Started())

    def add(self, chunk: common_pb2.TokenChunk) -> common_pb2.GenerateEvent:
        if self.first_token_at is None and chunk.token_ids:
            self.first_token_at = time.monotonic()
        self.token_ids.extend(chunk.token_ids)
        self.text.append(chunk.text)
        return common_pb2.GenerateEvent(chunk=chunk)

    def finish(self, reason: int, error_message: str = "") -> common_pb2.Finished:
        """Ends the transcript with a Finished made here (abort, deadline, error)."""
        self.finished = common_pb2.Finished(finish_reason=reason, error_message=error_message)  # type: ignore[arg-type]
        return self.finished

    def counts(self) -> TokenCounts:
        """Token usage: the router's counts when it sent them, else what passed through here."""
        reported = self.finished.usage if self.finished is not None else common_pb2.Usage()
        if self.response_cache_hit:
            return TokenCounts(
                prompt_tokens=self.prompt_tokens,
                cached_prompt_tokens=0,
                completion_tokens=0,
                response_cache_hit=True,
                delivered_tokens=len(self.token_ids),
            )
        return TokenCounts(
            prompt_tokens=reported.prompt_tokens or self.prompt_tokens,
            cached_prompt_tokens=reported.cached_prompt_tokens,
            completion_tokens=max(reported.completion_tokens, len(self.token_ids)),
        )

    def timings(self, kv_transfer_ms: float) -> common_pb2.Timings:
        return request_timings(
            self.arrived, self.first_token_at, queue_s=self.queue_s, kv_transfer_ms=kv_transfer_ms
        )

    @property
    def finish_reason(self) -> int:
        return self.finished.finish_reason if self.finished is not None else 0

    def is_complete_answer(self) -> bool:
        return self.finish_reason in RESULT_REASONS

    def cached_response(self) -> cache_pb2.CachedResponse:
        return cache_pb2.CachedResponse(
            token_ids=self.token_ids,
            text="".join(self.text),
            finish_reason=self.finish_reason,  # type: ignore[arg-type]
            prompt_tokens=self.prompt_tokens,
            model=self.model,
            stored_unix_ms=int(time.time() * 1000),
        )

    def replay(self) -> list[common_pb2.GenerateEvent]:
        """The whole answer as three events (Started, one chunk, Finished) for a repeat."""
        assert self.started is not None and self.finished is not None
        chunk = common_pb2.TokenChunk(token_ids=self.token_ids, text="".join(self.text))
        return [
            common_pb2.GenerateEvent(started=self.started),
            common_pb2.GenerateEvent(chunk=chunk),
            common_pb2.GenerateEvent(finished=self.finished),
        ]


def cache_hit_chunks(
    stored: cache_pb2.CachedResponse, tokenizer: TokenizerLike
) -> Iterator[common_pb2.TokenChunk]:
    """The stored answer in chunks of CACHE_HIT_CHUNK_TOKENS tokens.

    Each chunk's text is cut from the stored text where decoding its tokens so far ends, so
    the chunks' texts always add up to exactly the stored text (which may differ from a plain
    decode, e.g. when a stop string was cut off).
    """
    ids = list(stored.token_ids)
    text_end = 0
    for start in range(0, len(ids), CACHE_HIT_CHUNK_TOKENS):
        end = start + CACHE_HIT_CHUNK_TOKENS
        if end >= len(ids):
            cut = len(stored.text)
        else:
            decoded = tokenizer.decode(ids[:end]).rstrip("\ufffd")  # an unfinished character
            cut = min(max(len(decoded), text_end), len(stored.text))
        yield common_pb2.TokenChunk(token_ids=ids[start:end], text=stored.text[text_end:cut])
        text_end = cut
