"""least-load: the worker with the fewest requests, then the most free KV blocks, then the
one placed on least recently (idle workers take turns, so one added to the pool serves even
when requests come one at a time).

Also how every split request's decode worker is chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.router.policies.base import Pick, PromptQuery, prefer_fresh

if TYPE_CHECKING:
    from services.router.pools import WorkerState


class LeastLoad:
    """Fewest requests, then most free KV, then longest since placed on."""

    def pick(self, workers: list[WorkerState], query: PromptQuery) -> Pick:
        best = min(
            prefer_fresh(workers, query.avoid),
            key=lambda w: (w.load, -w.kv_blocks_free, w.last_placed),
        )
        reason = (
            f"{best.address}: {best.load} requests, "
            f"{best.kv_blocks_free}/{best.kv_blocks_total} KV blocks free"
        )
        return Pick(best, 0, reason)
