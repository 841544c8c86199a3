"""Request data types of the engine: what goes in, what comes out, and per-request state.

Everything a caller sees is a plain slots dataclass or enum; `RequestState` is the engine's own
mutable record of one request while it lives in the scheduler.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.contracts.constraints import Constraint
from kvmesh.contracts.sampling import DEFAULT_MAX_TOKENS, MAX_LOGPROBS

if TYPE_CHECKING:
    from services.worker.engine.output_processor import OutputProcessor

# torch.Generator.manual_seed takes any value that fits in 64 bits.
MAX_SEED = 2**64 - 1


class FinishReason(enum.Enum):
    """Why a request stopped producing tokens."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    DEADLINE = "deadline"
    ERROR = "error"


class Priority(enum.IntEnum):
    """Scheduling class; a lower value is served first."""

    INTERACTIVE = 0
    BATCH = 1


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    # Structured output: tokens are masked to those the constraint's grammar allows.
    constraint: Constraint | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.constraint is not None:
            self.constraint.validate()


@dataclass(slots=True)
class EngineRequest:
    """One generation request as the engine receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: Priority = Priority.INTERACTIVE
    # Mixed into every block hash: requests with different salts never share KV blocks.
    cache_salt: bytes = b""
    # time.monotonic() after which the request stops with FinishReason.DEADLINE.
    deadline: float | None = None

    def validate(self, vocab_size: int, context_length: int) -> None:
        """ValueError naming what no engine of this model could run: bad sampling fields, an
        empty prompt, token ids outside the vocabulary, a prompt that fills the context."""
        self.sampling.validate()
        prompt = self.prompt_token_ids
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids outside [0, {vocab_size}): {bad[:5]}")
        if len(prompt) >= context_length:
            raise ValueError(
                f"prompt of {len(prompt)} tokens leaves no room in the "
                f"{context_length}-token context"
            )


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of a sampled token and the most likely alternatives."""

    token_id: int
    logprob: float
    # (token id, logprob) of the top-n tokens, most likely first.
    top: list[tuple[int, float]]


@dataclass(slots=True)
class RequestOutput:
    """One event per engine step per request that produced something."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None


@dataclass(slots=True)
class KvHandle:
    """Blocks pinned after a prefill, until released."""

    handle_id: str
    block_ids: list[int]
    # Chained hashes of the blocks; the last is the hash of a partial block when the
    # prompt does not end on a block boundary.
    block_hashes: list[bytes]
    num_tokens: int


@dataclass(slots=True)
class ImportPlan:
    """Blocks allocated for a request whose KV comes from another engine."""

    request_id: str
    # Indices (into block_ids) of the blocks to pull, in lease order.
    missing_indices: list[int]
    block_ids: list[int]
    block_hashes: list[bytes]
    num_tokens: int
    request: EngineRequest
    written: set[int] = field(default_factory=set)


@dataclass(slots=True)
class Completion:
    """Result of one prompt through the offline LLM API."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    num_cached_prompt_tokens: int = 0


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
