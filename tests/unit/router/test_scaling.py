"""Replica recommendations from throughput, KV usage and queue depth."""

from __future__ import annotations

from kvmesh.v1 import worker_pb2
from services.router.pools import Role, WorkerState
from services.router.scaling import ScalingPolicy, WorkerLoad, recommended_replicas, worker_load

POLICY = ScalingPolicy(
    target_throughput_utilization=0.5, target_kv_usage=0.5, waiting_per_replica=2, warm_buffer=1
)


def idle(total_blocks: int = 100) -> WorkerLoad:
    return WorkerLoad(
        tokens_per_second=0.0, waiting=0, kv_blocks_used=0, kv_blocks_total=total_blocks
    )


def test_idle_pool_keeps_min_plus_warm_buffer() -> None:
    assert recommended_replicas([idle(), idle()], 100.0, POLICY) == 2
    assert recommended_replicas([], 100.0, POLICY) == 2


def test_throughput_pressure() -> None:
    busy = WorkerLoad(tokens_per_second=120.0, waiting=0, kv_blocks_used=0, kv_blocks_total=100)
    # 240 tok/s over 50 tok/s per worker (100 at 50 %) -> 5, plus 1 warm
    assert recommended_replicas([busy, busy], 100.0, POLICY) == 6


def test_kv_pressure() -> None:
    full = WorkerLoad(tokens_per_second=0.0, waiting=0, kv_blocks_used=90, kv_blocks_total=100)
    # 180 blocks used over 50 usable per worker -> 4, plus 1 warm
    assert recommended_replicas([full, full], 100.0, POLICY) == 5


def test_queue_pressure() -> None:
    queued = WorkerLoad(tokens_per_second=0.0, waiting=5, kv_blocks_used=0, kv_blocks_total=100)
    # 1 worker + ceil(5 / 2) = 4, plus 1 warm = 5
    assert recommended_replicas([queued], 100.0, POLICY) == 5


def test_worker_load_from_stats() -> None:
    worker = WorkerState("127.0.0.1:1", "tiny", Role.DECODE)
    assert worker_load(worker) == WorkerLoad(0.0, 0, 0, 0)
    worker.stats = worker_pb2.WorkerStats(
        tokens_per_second=12.5, waiting=3, kv_blocks_free=40, kv_blocks_total=100
    )
    assert worker_load(worker) == WorkerLoad(12.5, 3, 60, 100)
