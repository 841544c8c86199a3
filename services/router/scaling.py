"""Scaling signals: how many replicas a pool should have for the load it sees now.

Three pressures are turned into replica counts and the largest wins: generation throughput
against each worker's measured capacity, KV-cache occupancy, and requests queued. A warm
buffer of idle replicas is added on top, so a burst does not wait for a cold start.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.router.pools import WorkerState


@dataclass(slots=True, frozen=True)
class ScalingPolicy:
    """Targets behind the recommendation."""

    target_throughput_utilization: float = 0.7
    """Fraction of a worker's measured tokens/s it should run at."""
    target_kv_usage: float = 0.8
    """Fraction of a worker's KV blocks that may be in use."""
    waiting_per_replica: int = 4
    """Queued requests one more replica absorbs."""
    warm_buffer: int = 0
    """Idle replicas kept on top of the need."""
    min_replicas: int = 1
    """Never recommend fewer."""


@dataclass(slots=True, frozen=True)
class WorkerLoad:
    """What one worker reports (from its Stats)."""

    tokens_per_second: float
    """Tokens generated per second recently."""
    waiting: int
    """Requests queued in its engine."""
    kv_blocks_used: int
    """KV blocks in use."""
    kv_blocks_total: int
    """KV blocks in its pool."""


def recommended_replicas(
    workers: Sequence[WorkerLoad], capacity_tokens_per_second: float, policy: ScalingPolicy
) -> int:
    """Replicas the pool needs now: the largest of the three pressures, plus the warm buffer."""
    current = len(workers)
    total_tps = sum(w.tokens_per_second for w in workers)
    per_worker_tps = capacity_tokens_per_second * policy.target_throughput_utilization
    for_throughput = math.ceil(total_tps / per_worker_tps) if per_worker_tps > 0 else 0
    blocks_per_worker = max((w.kv_blocks_total for w in workers), default=0)
    used = sum(w.kv_blocks_used for w in workers)
    kv_capacity = blocks_per_worker * policy.target_kv_usage
    for_kv = math.ceil(used / kv_capacity) if kv_capacity > 0 else 0
    waiting = sum(w.waiting for w in workers)
    for_queue = current + math.ceil(waiting / policy.waiting_per_replica) if waiting else 0
    need = max(policy.min_replicas, for_throughput, for_kv, for_queue)
    return need + policy.warm_buffer


def worker_load(worker: WorkerState) -> WorkerLoad:
    """A worker's load as its latest Stats reported it (nothing known yet: idle)."""
    stats = worker.stats
    if stats is None:
        return WorkerLoad(tokens_per_second=0.0, waiting=0, kv_blocks_used=0, kv_blocks_total=0)
    return WorkerLoad(
        tokens_per_second=stats.tokens_per_second,
        waiting=stats.waiting,
        kv_blocks_used=stats.kv_blocks_total - stats.kv_blocks_free,
        kv_blocks_total=stats.kv_blocks_total,
    )
