"""Configuration of the router service."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kvmesh.config import ServerConfig


@dataclass(slots=True, frozen=True)
class RouterConfig(ServerConfig):
    """Settings of `python -m services.router --config pools.yaml`."""

    env_prefix: ClassVar[str] = "KVMESH_ROUTER_"

    port: int = 50052
    """gRPC port; 0 picks a free one."""
    metrics_port: int = 9452
    """Prometheus metrics HTTP port; 0 picks a free one, -1 disables it."""
    config: Path = Path("pools.yaml")
    """The pools file: model tiers, their workers, prices, fallbacks and the "auto" rule."""
    refresh_interval_s: float = 0.5
    """How often every worker's health and Stats are refreshed."""
    check_timeout_s: float = 1.0
    """Deadline of one health check or Stats call; a worker that misses it leaves rotation."""
    load_cost_tokens: int = 64
    """Prefix-cache hit tokens one request already on a worker is worth, when placing prefill:
    a worker wins with a longer cached prefix unless it carries this many tokens' worth more
    load per extra request."""
    scale_warm_buffer: int = 0
    """Idle replicas the scaling signal recommends on top of what the load needs."""
    scale_target_utilization: float = 0.7
    """Fraction of a worker's measured tokens/s the scaling signal plans for."""
    lease_ttl_ms: int = 0
    """KV lease TTL the router asks prefill workers for; 0 takes each worker's default."""
    stall_steps: float = 50.0
    """A stream whose decoding worker sends nothing for this many of its measured step times
    (and at least --stall-floor-s) has a stalled worker: it is failed over under the failure
    rules (after the first token: UNAVAILABLE with the usage so far)."""
    stall_floor_s: float = 2.0
    """The shortest silence that counts as a stalled worker."""
    stall_step_tokens: int = 1024
    """Prompt tokens in a worker's longest step (the workers' --max-num-batched-tokens): a
    colocated worker goes quiet for a whole prefill step of that many tokens while its streams
    decode, so none is called stalled before twice the worker's measured time for them."""
    dns_interval_s: float = 2.0
    """How often the pools file's dns:///NAME:PORT entries are resolved again (workers join
    and leave as the name's addresses change)."""
    dns_server: str = ""
    """host:port of the DNS server for dns:/// entries; empty: the system's (/etc/resolv.conf)."""

    def validate(self) -> None:
        """Raises ValueError naming the first setting out of range."""
        if self.refresh_interval_s <= 0 or self.check_timeout_s <= 0 or self.dns_interval_s <= 0:
            raise ValueError(
                "refresh_interval_s, check_timeout_s and dns_interval_s must be positive"
            )
        if self.stall_steps <= 0 or self.stall_floor_s <= 0 or self.stall_step_tokens <= 0:
            raise ValueError("stall_steps, stall_floor_s and stall_step_tokens must be positive")
        if self.load_cost_tokens < 0 or self.lease_ttl_ms < 0:
            raise ValueError("load_cost_tokens and lease_ttl_ms must be >= 0")
