"""Engine backends of the worker: kvmesh's own engine (the default) and vLLM.

`create_engine("native" | "vllm", config)` builds either behind the same API
(`services.worker.engine.api.EngineBackend`). The vLLM backend imports vLLM only when asked
for, so workers without the `kvmesh[vllm]` extra never touch it.
"""

from __future__ import annotations

from services.worker.config import ENGINE_KINDS
from services.worker.engine.api import EngineBackend
from services.worker.engine.config import EngineConfig

__all__ = ["ENGINE_KINDS", "EngineBackend", "create_engine"]


def create_engine(
    kind: str, config: EngineConfig, *, kv_wire_format: str = "vllm", vllm_eager: bool = False
) -> EngineBackend:
    """Load the model on the chosen backend (blocking); `kv_wire_format` and `vllm_eager`
    are vLLM's only (WorkerConfig says what they mean)."""
    if kind == "native":
        from services.worker.engine.async_engine import AsyncEngine

        engine = AsyncEngine.from_config(config)
        # The grammar backend's tokenizer tables (seconds) at start, on a compile thread: not
        # on the first constrained request, whose compile has a time limit.
        engine.engine.grammars.preload()
        return engine
    if kind == "vllm":
        from services.worker.backends.vllm_engine import VllmEngine

        return VllmEngine.from_config(config, kv_wire_format=kv_wire_format, eager=vllm_eager)
    raise ValueError(f"engine must be one of {ENGINE_KINDS}, got {kind!r}")
