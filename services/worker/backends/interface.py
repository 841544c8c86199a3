"""EngineBackend: what the worker service needs from an engine (docs/engine_api.md).

kvmesh's own AsyncEngine and the vLLM backend (VllmEngine) both satisfy it, so the servicer
can be typed against this protocol and run either.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from kvmesh.contracts.tokenizer import Tokenizer
from services.worker.engine.engine import EngineStats
from services.worker.engine.model_runner import KvLayout
from services.worker.engine.request import EngineRequest, ImportPlan, KvHandle, RequestOutput


class EngineBackend(Protocol):
    """One model behind the engine API: generation, abort, stats, KV export and import."""

    tokenizer: Tokenizer
    layout: KvLayout
    fingerprint: str
    model_name: str
    context_length: int

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def stats(self) -> EngineStats: ...

    def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def prefill_and_hold(
        self, req: EngineRequest
    ) -> tuple[RequestOutput, KvHandle | None]: ...

    async def export_blocks(self, handle_id: str, indices: list[int]) -> list[bytes]: ...

    async def release(self, handle_id: str) -> int: ...

    async def start_import(
        self, req: EngineRequest, block_hashes: list[bytes], num_tokens: int
    ) -> ImportPlan: ...

    async def write_imported_block(self, plan: ImportPlan, index: int, data: bytes) -> None: ...

    def commit_import(
        self, plan: ImportPlan, first_token_id: int
    ) -> AsyncIterator[RequestOutput]: ...

    async def cancel_import(self, plan: ImportPlan) -> None: ...
