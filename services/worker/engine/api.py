"""The engine's API: what both backends (kvmesh's AsyncEngine, the vLLM backend) implement and
the value types that cross it. Imports no torch, no gRPC and no service, so the worker's
servicer, its config and its tests can name these types without loading a model runtime.

Requests and sampling go in; RequestOutput events come out; a prefill can be held under a
KvHandle and its blocks exported; a decode imports another engine's blocks through an
ImportPlan; EngineStats reports load; KvLayout (with its format version) says which blocks two
engines can exchange. docs/engine_api.md describes each call.
"""

from __future__ import annotations

import enum
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.contracts.constraints import Constraint
from kvmesh.contracts.sampling import DEFAULT_MAX_TOKENS, MAX_LOGPROBS
from kvmesh.contracts.tokenizer import Tokenizer

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
    sampled_token_id: int | None = None
    """The token this step sampled for the request, also when new_token_ids leaves it out (a
    stop token, or text held back because it may begin a stop string): what a decode worker
    continues after."""
    sampled_logprob: TokenLogprob | None = None
    """Its log-probability, when the request asked for them."""


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


class KvCapacityError(RuntimeError):
    """The block pool cannot hold the blocks asked for."""


KV_FORMAT_VERSION = 1
"""Version of the bytes of one exported KV block (per layer: K then V, each block_size x
num_kv_heads x head_dim elements of `dtype`, in the engine's order). Bump it when that byte
order changes: engines exchange blocks only when their versions match."""

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(slots=True, frozen=True)
class KvLayout:
    """The shape of one engine's KV blocks; two engines exchange blocks only when theirs agree."""

    dtype: str
    """Element type, a torch dtype name without "torch.": "float32", "bfloat16", "float16"."""
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    engine: str = "native"
    """Backend that wrote the blocks ("native", "vllm"): the byte order of a block."""
    format_version: int = KV_FORMAT_VERSION

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: all layers, K and V."""
        itemsize = _DTYPE_BYTES[self.dtype]
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize


# Output tokens per second are measured over this trailing window.
THROUGHPUT_WINDOW_S = 10.0


@dataclass(slots=True)
class EngineStats:
    """Load and cache state of one engine, for the worker's Stats and gauges."""

    running: int
    waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    block_size: int
    prefix_queries_tokens: int
    prefix_hit_tokens: int
    cached_block_hashes: list[bytes]
    tokens_per_second: float
    layout: KvLayout
    fingerprint: str
    num_held_handles: int = 0
    num_preemptions: int = 0
    num_interrupted_steps: int = 0
    peak_tokens_per_second: float = 0.0
    """The most tokens per second sustained over a throughput window: measured capacity."""


class EngineBackend(Protocol):
    """One model behind the engine API: generation, abort, stats, KV export and import."""

    tokenizer: Tokenizer
    layout: KvLayout
    fingerprint: str
    model_name: str
    context_length: int

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def stats(self) -> EngineStats: ...

    def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def prefill_and_hold(
        self, req: EngineRequest
    ) -> tuple[RequestOutput, KvHandle | None]: ...

    async def export_blocks(self, handle_id: str, indices: list[int]) -> list[bytes]: ...

    async def release(self, handle_id: str) -> int: ...

    async def start_import(
        self, req: EngineRequest, block_hashes: list[bytes], num_tokens: int
    ) -> ImportPlan: ...

    async def write_imported_block(self, plan: ImportPlan, index: int, data: bytes) -> None: ...

    def commit_import(
        self, plan: ImportPlan, first_token_id: int, first_logprob: TokenLogprob | None = None
    ) -> AsyncIterator[RequestOutput]: ...

    async def cancel_import(self, plan: ImportPlan) -> None: ...
