"""prefix-affinity (the default): the longest cached prefix of the prompt, weighed against load.

score = prefix hit tokens - load_cost_tokens x requests on the worker; ties go to fewer
requests, then more free KV blocks.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from services.router.policies.base import Pick, PromptQuery, prefer_fresh

if TYPE_CHECKING:
    from services.router.pools import WorkerState


def leading_hits(hashes: Sequence[bytes], cached: Collection[bytes]) -> int:
    """How many leading blocks of the chain the cache holds (a chain breaks at the first miss)."""
    count = 0
    for block_hash in hashes:
        if block_hash not in cached:
            break
        count += 1
    return count


class PrefixAffinity:
    """Prefix hits minus load."""

    def pick(self, workers: list[WorkerState], query: PromptQuery) -> Pick:
        def hit_tokens(worker: WorkerState) -> int:
            return leading_hits(query.hashes, worker.cached_hashes) * query.block_size

        def score(worker: WorkerState) -> tuple[int, int, int]:
            gain = hit_tokens(worker) - query.load_cost_tokens * worker.load
            return (gain, -worker.load, worker.kv_blocks_free)

        best = max(prefer_fresh(workers, query.avoid), key=score)
        hits = hit_tokens(best)
        reason = (
            f"{best.address}: {hits} cached prefix tokens, {best.load} requests"
            if hits
            else f"{best.address}: no cached prefix anywhere better, {best.load} requests"
        )
        return Pick(best, hits, reason)
