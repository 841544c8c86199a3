"""Settings of the OpenAI HTTP door (flags > KVMESH_OPENAI_* environment > defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvmesh.config import ServerConfig


@dataclass(slots=True, frozen=True)
class OpenAIHttpConfig(ServerConfig):
    """The OpenAI-compatible HTTP front door of the admission gateway."""

    env_prefix: ClassVar[str] = "KVMESH_OPENAI_"

    port: int = 8000
    """HTTP port of the OpenAI API; 0 picks a free one."""
    metrics_port: int = 9454
    """Prometheus metrics HTTP port; 0 picks a free one, -1 disables the endpoint."""
    gateway: str = "127.0.0.1:50051"
    """Address (host:port) of the admission gateway's public gRPC port."""
    max_prompts: int = 32
    """Most prompts in one /v1/completions request (each is its own Generate call)."""
    health_timeout_s: float = 1.0
    """Deadline of the gateway health check behind GET /health."""
