"""kvmesh: serve LLMs as a mesh of gRPC services. The client SDK is `kvmesh.Client` (asyncio)
and `kvmesh.SyncClient`; errors are in `kvmesh.errors`.

The SDK is imported on first use, so services importing `kvmesh.config` or `kvmesh.errors` do
not pay for the client's gRPC channel machinery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmesh.client import Client, GenerationResult, SyncClient

__all__ = ["Client", "GenerationResult", "SyncClient"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvmesh import client

        return getattr(client, name)
    raise AttributeError(f"module 'kvmesh' has no attribute {name!r}")
