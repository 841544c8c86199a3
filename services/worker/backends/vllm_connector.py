"""kvmesh's KV connector for vLLM (KV connector API v1): leases out of vLLM, pulled KV into it.

vLLM loads this class by name (KVTransferConfig.kv_connector_module_path) in two places: the
scheduler process gets the scheduler half, the model worker process the worker half. The
blocks travel through `BlockFiles`, which the backend (services/worker/backends/
vllm_engine.py) also reads and writes:

- Export (prefill role). A request whose kv_transfer_params carry `kvmesh_export: key` has
  its prompt's blocks written to entry `key` by the worker half, at the end of the step that
  computes the prompt's last token, before vLLM sees the step's output (so before the request
  can finish and its blocks be reused). The backend then holds the entry under a kvmesh lease.
- Import (decode role). The backend fills entry `key` with pulled blocks, then submits the
  request with `kvmesh_import: {key, num_tokens, first_index}`. The scheduler half offers
  vLLM those tokens beyond its own prefix-cache hit; the worker half copies them into the
  blocks vLLM allocated, before the forward pass. When vLLM's own cache does not reach the
  first pulled block (it evicted the blocks the backend counted on), nothing is offered and
  vLLM recomputes the prompt: slower, never wrong.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index

from services.worker.backends.kv_files import BlockFiles
from services.worker.backends.kv_wire import pack_blocks, unpack_blocks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# kv_connector_extra_config keys.
EXTRA_STORE_DIR = "kvmesh_store_dir"
EXTRA_BLOCK_BYTES = "kvmesh_block_bytes"
EXTRA_WIRE_FORMAT = "kvmesh_wire_format"
# kv_transfer_params keys of one request.
PARAM_EXPORT = "kvmesh_export"
PARAM_IMPORT = "kvmesh_import"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class SaveSpec:
    """Write these blocks (in prompt order) to entry `key`."""

    key: str
    block_ids: list[int]


@dataclass(slots=True)
class LoadSpec:
    """Copy entry `key`'s blocks first_index, first_index + 1, ... into `block_ids`."""

    key: str
    block_ids: list[int]
    first_index: int


@dataclass
class KvmeshConnectorMetadata(KVConnectorMetadata):
    """What the worker half does in one step."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)


@dataclass(slots=True)
class _Export:
    """A prefill request whose prompt blocks go to an entry once they are all computed."""

    key: str
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)


class KvmeshConnector(KVConnectorBase_V1):
    """Both halves; vLLM builds one instance per role."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._block_size: int = vllm_config.cache_config.block_size
        self._files = BlockFiles(Path(extra[EXTRA_STORE_DIR]), int(extra[EXTRA_BLOCK_BYTES]))
        self._wire_format = str(extra[EXTRA_WIRE_FORMAT])
        # Scheduler half.
        self._exports: dict[str, _Export] = {}
        self._pending_loads: list[LoadSpec] = []
        # Worker half: one cache tensor per layer, in layer order.
        self._layers: list[torch.Tensor] = []
        self._failed_block_ids: set[int] = set()

    # ---- scheduler half -------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        key = _params(request).get(PARAM_EXPORT)
        if key is not None:
            self._exports[request.request_id] = _Export(str(key), request.num_prompt_tokens)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        spec = _params(request).get(PARAM_IMPORT)
        if spec is None:
            return 0, False
        num_tokens = int(spec["num_tokens"])
        covered = num_computed_tokens >= int(spec["first_index"]) * self._block_size
        if not covered or num_computed_tokens >= num_tokens or not self._files.exists(spec["key"]):
            return 0, False
        return num_tokens - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        spec = _params(request).get(PARAM_IMPORT)
        if spec is None or num_external_tokens <= 0:
            return
        num_tokens = int(spec["num_tokens"])
        first = (num_tokens - num_external_tokens) // self._block_size
        block_ids = blocks.get_block_ids()[0][first : cdiv(num_tokens, self._block_size)]
        self._pending_loads.append(LoadSpec(str(spec["key"]), list(block_ids), first))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvmeshConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            export = self._exports.get(new.req_id)
            if export is not None:
                export.block_ids = list(new.block_ids[0])
                self._save_if_done(
                    meta, new.req_id, new.num_computed_tokens + scheduled[new.req_id]
                )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            export = self._exports.get(req_id)
            if export is None:
                continue
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted: its block list starts over
                export.block_ids = []
            if new_block_ids is not None:
                export.block_ids.extend(new_block_ids[0])
            self._save_if_done(meta, req_id, cached.num_computed_tokens[i] + scheduled[req_id])
        return meta

    def _save_if_done(self, meta: KvmeshConnectorMetadata, req_id: str, computed: int) -> None:
        export = self._exports[req_id]
        if computed < export.num_prompt_tokens:
            return
        num_blocks = cdiv(export.num_prompt_tokens, self._block_size)
        meta.saves.append(SaveSpec(export.key, export.block_ids[:num_blocks]))
        del self._exports[req_id]

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # An export aborted before its prompt was computed leaves nothing behind.
        self._exports.pop(request.request_id, None)
        return False, None

    # ---- worker half ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=extract_layer_index)
        self._layers = [kv_caches[name] for name in names]
        model = self._vllm_config.model_config
        expected = (model.get_total_num_kv_heads(), self._block_size, 2 * model.get_head_size())
        shapes = {tuple(layer.shape[1:]) for layer in self._layers}
        if shapes != {expected}:
            # kv_wire knows the CPU attention backend's layout only (see its docstring).
            raise RuntimeError(
                f"kvmesh's connector expects vLLM CPU KV caches [blocks, {expected}], "
                f"got {sorted(shapes)}"
            )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvmeshConnectorMetadata)
        for load in meta.loads:
            indices = range(load.first_index, load.first_index + len(load.block_ids))
            try:
                blocks = self._files.read_blocks(load.key, list(indices))
            except (KeyError, ValueError):
                # The entry went away (the import was cancelled): vLLM recomputes these.
                log.warning("kvmesh import entry %s is gone; recomputing", load.key)
                self._failed_block_ids.update(load.block_ids)
                continue
            unpack_blocks(self._layers, load.block_ids, blocks, self._wire_format)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done in start_load_kv

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # exports are written whole in wait_for_save, after every layer ran

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvmeshConnectorMetadata)
        for save in meta.saves:
            blocks = pack_blocks(self._layers, save.block_ids, self._wire_format)
            self._files.write_entry(save.key, blocks)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed


def _params(request: Request) -> dict[str, Any]:
    return request.kv_transfer_params or {}
