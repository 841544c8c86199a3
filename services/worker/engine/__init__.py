"""kvmesh's inference engine: paged KV cache, continuous batching, prefix caching, KV transfer.

`from services.worker.engine import LLM, AsyncEngine, SamplingParams, ...`. Exports load
lazily, so that importing a torch-free submodule (tokenizer, used by the admission gateway)
does not import torch through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.worker.engine.async_engine import AsyncEngine
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.engine import Engine, EngineStats
    from services.worker.engine.kv_cache_manager import (
        KvCapacityError,
        hash_block,
        hash_block_chain,
    )
    from services.worker.engine.llm import LLM
    from services.worker.engine.loader import LoadedModel, load_model
    from services.worker.engine.model_runner import KvLayout
    from services.worker.engine.request import (
        Completion,
        EngineRequest,
        FinishReason,
        ImportPlan,
        KvHandle,
        Priority,
        RequestOutput,
        SamplingParams,
        TokenLogprob,
    )
    from services.worker.engine.tokenizer import IncrementalDetokenizer, Tokenizer

_EXPORTS = {
    "AsyncEngine": "async_engine",
    "EngineConfig": "config",
    "Engine": "engine",
    "EngineStats": "engine",
    "KvCapacityError": "kv_cache_manager",
    "hash_block": "kv_cache_manager",
    "hash_block_chain": "kv_cache_manager",
    "LLM": "llm",
    "LoadedModel": "loader",
    "load_model": "loader",
    "KvLayout": "model_runner",
    "Completion": "request",
    "EngineRequest": "request",
    "FinishReason": "request",
    "ImportPlan": "request",
    "KvHandle": "request",
    "Priority": "request",
    "RequestOutput": "request",
    "SamplingParams": "request",
    "TokenLogprob": "request",
    "IncrementalDetokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
}

__all__ = [
    "LLM",
    "AsyncEngine",
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "ImportPlan",
    "IncrementalDetokenizer",
    "KvCapacityError",
    "KvHandle",
    "KvLayout",
    "LoadedModel",
    "Priority",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
    "Tokenizer",
    "hash_block",
    "hash_block_chain",
    "load_model",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
