"""ModelRunner: one forward pass over a mixed varlen batch, against the paged KV cache it owns.

The KV cache is one tensor [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads,
head_dim]; a block's bytes on the wire (read_block/write_block) are its slice over all layers
in that order: layer, K/V, token, kv head, dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate, chain

import torch

from services.worker.engine.attention import AttentionBatch, LayerKvCache, PrefillSpan
from services.worker.engine.loader import LoadedModel
from services.worker.engine.models.llama import ModelConfig


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(slots=True, frozen=True)
class KvLayout:
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32", "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    engine: str = "native"

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: all layers, K and V."""
        itemsize: int = getattr(torch, self.dtype).itemsize
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize


@dataclass(slots=True)
class BatchEntry:
    token_ids: list[int]  # the tokens to compute this step (a prefill chunk, or one decode token)
    start_pos: int  # tokens of this sequence already in the KV cache
    block_table: list[int]  # block ids covering positions [0, start_pos + len(token_ids))
    want_logits: bool = True  # False for a prefill chunk that does not reach the end of the prompt


@dataclass(slots=True)
class ForwardPlan:
    token_ids: torch.Tensor  # [T], rows in execution order (decodes first)
    positions: torch.Tensor  # [T]
    attention: AttentionBatch
    logit_rows: torch.Tensor  # rows whose logits are returned, in the caller's entry order


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        config = loaded.config
        self.model = loaded.model
        self.config = config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layout = KvLayout(
            dtype=dtype_name(loaded.dtype),
            block_size=block_size,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
        )
        self.kv_cache = torch.zeros(
            (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim),
            dtype=loaded.dtype,
            device=loaded.device,
        )
        self._layer_caches = [LayerKvCache.of(layer_kv) for layer_kv in self.kv_cache.unbind(0)]

    @staticmethod
    def bytes_per_block(config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
        return KvLayout(
            dtype=dtype_name(dtype),
            block_size=block_size,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
        ).block_bytes

    def forward(self, batch: list[BatchEntry]) -> torch.Tensor:
        """fp32 logits [entries with want_logits, vocab], in batch order."""
        with torch.inference_mode():
            plan = self._plan(batch)
            hidden = self.model(plan.token_ids, plan.positions, self._layer_caches, plan.attention)
            return self.model.compute_logits(hidden[plan.logit_rows])

    def read_block(self, block_id: int) -> bytes:
        self._check_block_id(block_id)
        block = self.kv_cache[:, :, block_id].contiguous().cpu()
        return block.view(torch.uint8).numpy().tobytes()

    def write_block(self, block_id: int, data: bytes) -> None:
        self._check_block_id(block_id)
        if len(data) != self.layout.block_bytes:
            raise ValueError(
                f"block data is {len(data)} bytes, layout {self.layout} needs "
                f"{self.layout.block_bytes}"
            )
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype)
        target = self.kv_cache[:, :, block_id]
        target.copy_(raw.view(target.shape))

    def _check_block_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} outside [0, {self.num_blocks})")

    def _validate(self, entry: BatchEntry) -> None:
        end = entry.start_pos + len(entry.token_ids)
        if not entry.token_ids or entry.start_pos < 0:
            raise ValueError(f"entry needs >= 1 token and start_pos >= 0: {entry.start_pos=}")
        if len(entry.block_table) * self.block_size < end:
            raise ValueError(
                f"block table of {len(entry.block_table)} blocks cannot hold {end} tokens"
            )
        if end > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence of {end} tokens exceeds the model's "
                f"{self.config.max_position_embeddings} positions"
            )

    def _plan(self, batch: list[BatchEntry]) -> ForwardPlan:
        """Turn the entries into flat tensors with vectorized ops (no per-token Python)."""
        if not batch:
            raise ValueError("empty batch")
        for entry in batch:
            self._validate(entry)
        order = sorted(range(len(batch)), key=lambda i: len(batch[i].token_ids) != 1)
        entries = [batch[i] for i in order]
        num_decode = sum(1 for e in entries if len(e.token_ids) == 1)
        lens = [len(e.token_ids) for e in entries]
        row_starts = [0, *accumulate(lens)]
        bs = self.block_size

        lens_t = torch.tensor(lens)
        starts_t = torch.tensor([e.start_pos for e in entries])
        entry_of_row = torch.repeat_interleave(torch.arange(len(entries)), lens_t)
        row_offsets = torch.arange(row_starts[-1]) - torch.tensor(row_starts[:-1])[entry_of_row]
        positions = starts_t[entry_of_row] + row_offsets
        max_blocks = max(len(e.block_table) for e in entries)
        tables = torch.tensor(
            [e.block_table + [0] * (max_blocks - len(e.block_table)) for e in entries]
        )
        slots = tables[entry_of_row, positions // bs] * bs + positions % bs

        decode_context = starts_t[:num_decode] + 1
        decode_blocks = math.ceil(int(decode_context.max()) / bs) if num_decode else 0
        decode_mask = self._additive_mask(
            torch.arange(decode_blocks * bs) >= decode_context[:, None]
        )
        prefills = [
            self._prefill_span(entries[j], row_starts[j], row_starts[j + 1], tables[j])
            for j in range(num_decode, len(entries))
        ]
        position_in_order = {original: j for j, original in enumerate(order)}
        logit_rows = [
            row_starts[position_in_order[i] + 1] - 1 for i, e in enumerate(batch) if e.want_logits
        ]
        device = self.device
        return ForwardPlan(
            token_ids=torch.tensor(list(chain.from_iterable(e.token_ids for e in entries))).to(
                device
            ),
            positions=positions.to(device),
            attention=AttentionBatch(
                slots=slots.to(device),
                num_decode=num_decode,
                decode_block_ids=tables[:num_decode, :decode_blocks].reshape(-1).to(device),
                decode_mask=decode_mask.view(num_decode, 1, 1, decode_blocks * bs).to(device),
                prefills=prefills,
            ),
            logit_rows=torch.tensor(logit_rows, dtype=torch.long).to(device),
        )

    def _additive_mask(self, blocked: torch.Tensor) -> torch.Tensor:
        """Bool "may not attend" -> additive 0 / -inf mask (SDPA on CPU runs faster with it)."""
        return torch.zeros(blocked.shape, dtype=self.dtype).masked_fill_(blocked, -math.inf)

    def _prefill_span(
        self, entry: BatchEntry, row_start: int, row_end: int, table: torch.Tensor
    ) -> PrefillSpan:
        context = entry.start_pos + len(entry.token_ids)
        mask = None
        if entry.start_pos > 0:
            query_positions = torch.arange(entry.start_pos, context)
            future = torch.arange(context)[None, :] > query_positions[:, None]
            mask = self._additive_mask(future).to(self.device)
        return PrefillSpan(
            row_start=row_start,
            row_end=row_end,
            block_ids=table[: math.ceil(context / self.block_size)].to(self.device),
            mask=mask,
        )
