"""round-robin: each worker in rotation in turn, whatever its load or cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.router.policies.base import Pick, PromptQuery, prefer_fresh

if TYPE_CHECKING:
    from services.router.pools import WorkerState


class RoundRobin:
    """The next worker after the one picked last, in address order."""

    def __init__(self) -> None:
        self._last = ""

    def pick(self, workers: list[WorkerState], query: PromptQuery) -> Pick:
        candidates = sorted(prefer_fresh(workers, query.avoid), key=lambda w: w.address)
        best = next((w for w in candidates if w.address > self._last), candidates[0])
        self._last = best.address
        return Pick(best, 0, f"{best.address}: next in turn, {best.load} requests")
