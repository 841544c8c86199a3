"""The engine's own mutable record of one request while it lives in the scheduler.

What callers see (requests, sampling, outputs, handles, plans) is in `api.py`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.worker.engine.api import EngineRequest, Priority

if TYPE_CHECKING:
    from services.worker.engine.grammar import GrammarMatcher
    from services.worker.engine.output_processor import OutputProcessor


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class RequestState:
    """The engine's mutable record of one live request (compared by identity)."""

    request: EngineRequest
    # Order of arrival in the engine: FIFO within a class, newest preempted first.
    arrival_seq: int
    # Prompt followed by every sampled token.
    token_ids: list[int]
    num_prompt_tokens: int
    processor: OutputProcessor
    # Stop after the first sampled token and keep the prompt's blocks pinned (prefill role).
    hold_after_prefill: bool = False
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose KV is in the cache; reset to 0 when preempted (recompute).
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    admitted_once: bool = False
    # Chained hashes of the full blocks of token_ids computed so far (a cache: tokens of a
    # full block never change, so neither do their hashes).
    block_hashes: list[bytes] = field(default_factory=list)
    # Where a constrained request is in its grammar (advanced by every sampled token; kept
    # across a preemption, since the tokens are).
    matcher: GrammarMatcher | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def priority(self) -> Priority:
        return self.request.priority

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
