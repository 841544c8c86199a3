"""Registries with hand-set worker state for placement tests."""

from __future__ import annotations

from kvmesh.v1 import worker_pb2
from services.router.pools import PoolRegistry, WorkerState
from services.router.tiers import AutoRule, PoolsConfig, TierSpec

FINGERPRINT = "fp"


def tier(
    name: str,
    *,
    prefill: tuple[str, ...] = (),
    decode: tuple[str, ...] = (),
    colocated: tuple[str, ...] = (),
    fallback: str = "",
) -> TierSpec:
    return TierSpec(
        name=name,
        base_model=name,
        quantization="none",
        usd_per_gpu_hour=1.0,
        tokens_per_second=100.0,
        fallback=fallback,
        prefill=prefill,
        decode=decode,
        colocated=colocated,
    )


def registry(*tiers: TierSpec, auto: AutoRule | None = None) -> PoolRegistry:
    return PoolRegistry(PoolsConfig(tiers=tiers, auto=auto))


def stats(
    *,
    running: int = 0,
    waiting: int = 0,
    free: int = 100,
    total: int = 100,
    hashes: list[bytes] | None = None,
) -> worker_pb2.WorkerStats:
    return worker_pb2.WorkerStats(
        model_fingerprint=FINGERPRINT,
        running=running,
        waiting=waiting,
        kv_blocks_free=free,
        kv_blocks_total=total,
        block_size=16,
        cached_block_hashes=hashes or [],
    )


def healthy(pools: PoolRegistry, address: str, **fields: object) -> list[WorkerState]:
    pools.record_check(address, stats(**fields))  # type: ignore[arg-type]
    return [w for w in pools.workers() if w.address == address]
