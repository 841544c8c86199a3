"""Configuration of the worker service."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kvmesh.config import ServerConfig
from services.worker.engine.config import EngineConfig

ENGINE_KINDS = ("native", "vllm")
"""Engine backends a worker can run (services/worker/backends)."""
ROLES = ("prefill", "decode", "colocated")


@dataclass(slots=True, frozen=True)
class WorkerConfig(ServerConfig):
    """Settings of `python -m services.worker`."""

    env_prefix: ClassVar[str] = "KVMESH_WORKER_"

    port: int = 50061
    """gRPC port; 0 picks a free one."""
    metrics_port: int = 9461
    """Prometheus metrics HTTP port; 0 picks a free one, -1 disables it."""
    role: str = "colocated"
    """What this worker serves: "prefill" (Prefill, PullKv, ReleaseKv), "decode" (Decode) or
    "colocated" (Generate, and every split RPC)."""
    tier: str = ""
    """Model tier name reported in Stats (e.g. "smollm2-135m-int8"); empty: the model's name."""
    lease_ttl_s: float = 30.0
    """Time a KV lease holds its blocks when nobody pulls or releases it; a Prefill's caller
    may ask for a shorter one, never a longer one."""
    lease_sweep_interval_s: float = 0.25
    """How often expired leases are looked for (and the gauges refreshed)."""
    advertise_address: str = ""
    """host:port other workers dial to pull this worker's leases; empty: host and bound port;
    :PORT (no host): this machine's own address, e.g. each replica of a compose service its
    container's IP (deploy/compose.replicas.yaml)."""
    kv_chunk_bytes: int = 1 << 20
    """Largest data piece of one KvChunk on PullKv (at most 1 MiB)."""
    kv_send_max_mb_s: float = 0.0
    """Cap on the rate this worker sends KV on PullKv, in MB/s (10**6 bytes); 0: no cap."""
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    """The engine's settings (model, device, dtype, KV budget, batching, prefix caching, kernels):
    each of its fields is a flag and a KVMESH_WORKER_ variable of its own (see --help)."""
    engine: str = "native"
    """Engine backend: "native" (kvmesh's own) or "vllm" (needs the kvmesh[vllm] extra)."""
    kv_wire_format: str = "vllm"
    """vLLM backend only: KV byte order on the wire, "vllm" (its own) or "native" (so native
    workers can pull its blocks; needs block_size 32 on both sides)."""
    vllm_eager: bool = False
    """vLLM backend only: run the model eagerly instead of compiled by inductor (vLLM's CPU
    default, which costs a few minutes at start on a small CPU; tests take eager)."""
    nice: int = 10
    """How far below the services beside it the worker's CPU priority goes (added to its
    niceness at start, 0-19; its engine's processes inherit it). On a machine it shares with
    a gateway and a router, their short bursts of work (an admission decision, a refusal, a
    streamed token) then preempt its compute threads instead of waiting behind a step; alone
    in a container it changes nothing."""

    def validate(self) -> None:
        """Raises ValueError naming the first setting out of range."""
        self.engine_config.validate()
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 0 < self.kv_chunk_bytes <= 1 << 20:
            raise ValueError(f"kv_chunk_bytes must be in [1, 1 MiB], got {self.kv_chunk_bytes}")
        if self.lease_ttl_s <= 0 or self.lease_sweep_interval_s <= 0:
            raise ValueError("lease_ttl_s and lease_sweep_interval_s must be positive")
        if self.kv_send_max_mb_s < 0:
            raise ValueError(f"kv_send_max_mb_s must be >= 0, got {self.kv_send_max_mb_s}")
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"engine must be one of {ENGINE_KINDS}, got {self.engine!r}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice must be in [0, 19], got {self.nice}")
        if self.kv_wire_format not in ("vllm", "native"):
            raise ValueError(f"kv_wire_format must be vllm or native, got {self.kv_wire_format!r}")

    @property
    def serves_prefill(self) -> bool:
        return self.role in ("prefill", "colocated")

    @property
    def serves_decode(self) -> bool:
        return self.role in ("decode", "colocated")
