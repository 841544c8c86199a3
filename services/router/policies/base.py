"""What every placement policy takes and gives: the protocol and its value types."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from services.router.pools import WorkerState


@dataclass(slots=True, frozen=True)
class Pick:
    """A chosen worker and why."""

    worker: WorkerState
    prefix_hit_tokens: int
    reason: str


@dataclass(slots=True, frozen=True)
class PromptQuery:
    """What a policy may weigh about the prompt to place."""

    hashes: Sequence[bytes]
    """The prompt's full-block hashes, as the workers' prefix caches name them."""
    block_size: int
    load_cost_tokens: int
    """Prefix-hit tokens one request on a worker is worth (prefix-affinity's exchange rate)."""
    avoid: Collection[str] = ()
    """Workers of a failed attempt, used only when no other is in rotation."""


class PlacementPolicy(Protocol):
    """Picks one of the workers in rotation (never empty) for a prompt."""

    def pick(self, workers: list[WorkerState], query: PromptQuery) -> Pick: ...


def prefer_fresh(workers: list[WorkerState], avoid: Collection[str]) -> list[WorkerState]:
    """The workers not to avoid, or all of them when every one is to be avoided."""
    fresh = [w for w in workers if w.address not in avoid]
    return fresh or workers
