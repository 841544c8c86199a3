"""ModelRunner: one forward pass over a mixed varlen batch, against the paged KV cache it owns.

The KV cache is one tensor [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads,
head_dim]; a block's bytes on the wire (read_block/write_block) are its slice over all layers
in that order: layer, K/V, token, kv head, dim.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate, chain

import numpy as np
import torch

from services.worker.engine.api import KvLayout
from services.worker.engine.attention import (
    AttentionBatch,
    DecodeGroup,
    KernelDecode,
    LastLayerRows,
    LayerKvCache,
    PrefillSpan,
    last_layer_rows,
)
from services.worker.engine.decode_kernel import DecodeKernel
from services.worker.engine.decode_layers_kernel import (
    DecodeLayers,
    decode_layers_library,
    expressible,
    int8_projections,
    layer_projections,
)
from services.worker.engine.huge_pages import huge_page_bytes
from services.worker.engine.kernel_build import KernelUnavailable
from services.worker.engine.linear_kernel import (
    PackedProject,
    SmallBatchLinear,
    kernel_weights,
    place_weights,
)
from services.worker.engine.loader import LoadedModel, dtype_name
from services.worker.engine.models import StepInterrupted
from services.worker.engine.models.llama import (
    LlamaModel,
    ModelConfig,
    Project,
    project_with_torch,
)
from services.worker.engine.prefill_kernel import PrefillKernel
from services.worker.engine.rope_store_kernel import RopeStoreKernel

logger = logging.getLogger(__name__)


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
    # What the last layer computes past its K/V where that is fewer than all rows (a step
    # with prefill chunks); run layer by layer, the model then returns only those rows.
    last_layer_rows: LastLayerRows | None = None


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int = 16,
        *,
        decode_kernel: DecodeKernel | None = None,
        prefill_kernel: PrefillKernel | None = None,
        rope_store_kernel: RopeStoreKernel | None = None,
        linear_kernel: SmallBatchLinear | None = None,
        project: Project | None = None,
        fuse_small_decodes: bool = True,
    ) -> None:
        """decode_kernel: attends the decode rows when given (CPU float32 or bfloat16); SDPA
        otherwise.
        prefill_kernel: attends each prefill chunk when given (CPU float32 or bfloat16); SDPA
        otherwise.
        rope_store_kernel: rotates each layer's Q/K and stores its K/V when given (CPU
        float32 or bfloat16); torch's ops otherwise.
        linear_kernel: runs the projections of steps with few rows when given (CPU float32),
        on the weights it streams moved onto huge pages (linear_kernel.place_weights), as are
        a PackedProject's that streams some steps' weights itself.
        project: runs the projections where no linear_kernel is given (a bfloat16 model on
        the CPU: linear_kernel.PackedProject); torch's ops when neither is.
        fuse_small_decodes: with the decode and RoPE/store kernels and the linear kernel (or
        a bfloat16 model's PackedProject with its library), a step of only decode rows (up to
        DecodeLayers.max_rows) runs its layers in one C call (decode_layers_kernel.py; the
        same numbers); with the prefill kernel too, so does a step with prefill chunks that
        nothing may interrupt between layers, where the larger steps' projections run on
        panels."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        config = loaded.config
        self.model = loaded.model
        self.config = config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        self.rope_store_kernel = rope_store_kernel
        self.project: Project = linear_kernel or project or project_with_torch
        if linear_kernel is not None or (
            isinstance(project, PackedProject) and project.streams_weights
        ):
            place_weights(loaded.model)
        self.onednn_from_rows = self._measure_crossover()
        """Steps of this many rows or more run layer by layer: oneDNN runs some of their
        projections, which decode_layers.c does not call (None: every step may fuse)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layout = ModelRunner.layout_of(config, loaded.dtype, block_size)
        self.kv_cache = kv_cache_tensor(
            (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim),
            loaded.dtype,
            loaded.device,
        )
        self._layer_caches = [LayerKvCache.of(layer_kv) for layer_kv in self.kv_cache.unbind(0)]
        self.decode_layers = (
            self._decode_layers(rope_store_kernel, decode_kernel) if fuse_small_decodes else None
        )

    def _measure_crossover(self) -> int | None:
        """Where the runner's Project measures oneDNN against the panel kernel (the linear
        kernel's float32 projections, or a bfloat16 model's PackedProject), measures this
        model's layer projections and returns the fewest rows any of them runs on oneDNN
        from."""
        project = self.project
        crossover = (
            project.crossover if isinstance(project, SmallBatchLinear | PackedProject) else None
        )
        if crossover is None or not isinstance(self.model, LlamaModel):
            return None
        layers = [
            [
                weights[0]
                for module in layer_projections(layer)
                if (weights := kernel_weights(module)) is not None and weights[1] is None
            ]
            for layer in self.model.decoder_layers()
        ]
        crossover.calibrate(layers)
        return crossover.least_rows(layers[0]) if layers else None

    def _decode_layers(
        self, rope_store: RopeStoreKernel | None, attention: DecodeKernel | None
    ) -> DecodeLayers | None:
        """decode_layers.c's build for the model's dtype over the kernels this runner calls,
        where it can express the model and the runner's Project (the float32 linear kernel,
        or a bfloat16 model's PackedProject with its library) runs the layers' projections."""
        if rope_store is None or attention is None or not expressible(self.model):
            return None
        project, int8 = self.project, int8_projections(self.model)
        projections = (
            project.layer_projections(int8)
            if isinstance(project, SmallBatchLinear | PackedProject)
            else None
        )
        if projections is None:
            return None
        try:
            library = decode_layers_library(self.dtype)
        except KernelUnavailable as exc:
            logger.warning("decode steps run layer by layer: %s", exc)
            return None
        kernels = (projections, rope_store, attention)
        return DecodeLayers(
            library, self.model, self._layer_caches, self.block_size, kernels, self.prefill_kernel
        )

    @staticmethod
    def layout_of(config: ModelConfig, dtype: torch.dtype, block_size: int) -> KvLayout:
        """The KV layout of a model of this config and dtype, in blocks of block_size."""
        return KvLayout(
            dtype=dtype_name(dtype),
            block_size=block_size,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
        )

    @staticmethod
    def bytes_per_block(config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
        return ModelRunner.layout_of(config, dtype, block_size).block_bytes

    def forward(
        self, batch: list[BatchEntry], interrupt: Callable[[], bool] | None = None
    ) -> torch.Tensor:
        """fp32 logits [entries with want_logits, vocab], in batch order.

        interrupt: asked between layers; True stops the pass with StepInterrupted."""
        with torch.inference_mode():
            plan = self._plan(batch)
            attention = plan.attention
            if (layers := self._fused_layers(attention, interrupt)) is not None:
                # Asked once: a decode step's layers run in one call, tens of milliseconds
                # at most (a step with chunks comes here only uninterruptible).
                if interrupt is not None and interrupt():
                    raise StepInterrupted
                hidden = layers(
                    self.model.embed_tokens(plan.token_ids),
                    self.model.rotary.lookup(plan.positions),
                    attention.slots,
                    attention.kernel_decode,
                    attention.prefills,
                )
            else:
                hidden = self.model(
                    plan.token_ids,
                    plan.positions,
                    self._layer_caches,
                    attention,
                    interrupt,
                    self.project,
                    plan.last_layer_rows,
                )
            # Either way the last layer output only the kept rows, where it kept fewer.
            kept = plan.last_layer_rows
            logit_rows = plan.logit_rows if kept is None else kept.logit_rows
            return self.model.compute_logits(hidden[logit_rows], self.project)

    def _fused_layers(
        self, attention: AttentionBatch, interrupt: Callable[[], bool] | None
    ) -> DecodeLayers | None:
        """decode_layers where it runs the step's layers in one call, else None: a step of up
        to its max_rows decode rows, or, where it runs prefills, one with chunks that all
        attend on the prefill kernel and that nothing interrupts (a chunk's step may take
        seconds: a batch step stays interruptible between layers); never one of as many rows
        as oneDNN runs projections of."""
        layers = self.decode_layers
        decode = attention.kernel_decode
        if layers is None or attention.decode_groups:
            return None
        if self.onednn_from_rows is not None and attention.slots.shape[0] >= self.onednn_from_rows:
            return None
        if not attention.prefills:
            fits = decode is not None and decode.rows <= layers.max_rows
        else:
            fits = (
                layers.runs_prefills
                and interrupt is None
                and all(span.kernel is not None for span in attention.prefills)
            )
        return layers if fits else None

    def read_block(self, block_id: int) -> bytes:
        self._check_block_id(block_id)
        block = self.kv_cache[:, :, block_id].view(torch.uint8)
        if block.device.type != "cpu":
            return block.contiguous().cpu().numpy().tobytes()
        # numpy gathers the strided slice in one single-threaded pass: torch's copy wakes its
        # intra-op threads, which takes milliseconds when the cores are busy.
        return block.numpy().tobytes()

    def write_block(self, block_id: int, data: bytes) -> None:
        self._check_block_id(block_id)
        if len(data) != self.layout.block_bytes:
            raise ValueError(
                f"block data is {len(data)} bytes, layout {self.layout} needs "
                f"{self.layout.block_bytes}"
            )
        target = self.kv_cache[:, :, block_id].view(torch.uint8)
        if target.device.type != "cpu":
            target.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(target.shape))
            return
        # Straight from the received bytes, single-threaded (see read_block).
        target.numpy()[...] = np.frombuffer(data, dtype=np.uint8).reshape(target.shape)

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
        # Decode entries first, longest context first (so groups of similar length are runs).
        order = sorted(
            range(len(batch)),
            key=lambda i: (len(batch[i].token_ids) != 1, -batch[i].start_pos),
        )
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
        if tables.min() < 0 or tables.max() >= self.num_blocks:
            # The kernels write K/V through these ids unchecked: one outside the cache would
            # write over other memory.
            raise ValueError(f"block table holds an id outside [0, {self.num_blocks})")
        slots = tables[entry_of_row, positions // bs] * bs + positions % bs

        decode_groups, kernel_decode = self._decode_plan(entries[:num_decode], tables)
        prefills = [
            self._prefill_span(entries[j], row_starts[j], row_starts[j + 1], tables[j])
            for j in range(num_decode, len(entries))
        ]
        position_in_order = {original: j for j, original in enumerate(order)}
        logit_rows = [
            row_starts[position_in_order[i] + 1] - 1 for i, e in enumerate(batch) if e.want_logits
        ]
        device = self.device
        attention = AttentionBatch(
            slots=slots.to(device),
            rope_store=self.rope_store_kernel,
            decode_groups=decode_groups,
            kernel_decode=kernel_decode,
            prefills=prefills,
        )
        return ForwardPlan(
            token_ids=torch.tensor(list(chain.from_iterable(e.token_ids for e in entries))).to(
                device
            ),
            positions=positions.to(device),
            attention=attention,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long).to(device),
            last_layer_rows=last_layer_rows(attention, logit_rows),
        )

    def _additive_mask(self, blocked: torch.Tensor) -> torch.Tensor:
        """Bool "may not attend" -> additive 0 / -inf mask (SDPA on CPU runs faster with it)."""
        return torch.zeros(blocked.shape, dtype=self.dtype).masked_fill_(blocked, -math.inf)

    def _decode_plan(
        self, decodes: list[BatchEntry], tables: torch.Tensor
    ) -> tuple[list[DecodeGroup], KernelDecode | None]:
        """The decode entries (the first rows) as one kernel call, or as SDPA groups."""
        if not decodes:
            return [], None
        if self.decode_kernel is not None:
            max_blocks = max(len(e.block_table) for e in decodes)
            kernel_decode = KernelDecode(
                kernel=self.decode_kernel,
                block_tables=tables[: len(decodes), :max_blocks].contiguous(),
                context_lens=torch.tensor([e.start_pos + 1 for e in decodes]),
                window=self.config.sliding_window or 0,
            )
            return [], kernel_decode
        bs = self.block_size
        groups = [
            self._decode_group(decodes, start, end, tables)
            for start, end in padding_groups([math.ceil((e.start_pos + 1) / bs) for e in decodes])
        ]
        return groups, None

    def _decode_group(
        self, entries: list[BatchEntry], start: int, end: int, tables: torch.Tensor
    ) -> DecodeGroup:
        """Entries [start, end) (sorted longest first) padded to the first one's blocks."""
        context = torch.tensor([e.start_pos + 1 for e in entries[start:end]])
        blocks = math.ceil(int(context[0]) / self.block_size)
        positions = torch.arange(blocks * self.block_size)
        padding = positions >= context[:, None]
        if (window := self.config.sliding_window) is not None:
            padding |= positions < context[:, None] - window  # before the sliding window
        return DecodeGroup(
            row_start=start,
            row_end=end,
            block_ids=tables[start:end, :blocks].reshape(-1).to(self.device),
            mask=self._additive_mask(padding).view(end - start, 1, 1, -1).to(self.device),
        )

    def _prefill_span(
        self, entry: BatchEntry, row_start: int, row_end: int, table: torch.Tensor
    ) -> PrefillSpan:
        context = entry.start_pos + len(entry.token_ids)
        return PrefillSpan(
            row_start=row_start,
            row_end=row_end,
            block_ids=table[: math.ceil(context / self.block_size)].to(self.device),
            mask=None if self.prefill_kernel is not None else self._prefill_mask(entry),
            prefix_len=entry.start_pos,
            kernel=self.prefill_kernel,
            window=self.config.sliding_window or 0,
            want_logits=entry.want_logits,
        )

    def _prefill_mask(self, entry: BatchEntry) -> torch.Tensor | None:
        """The [chunk, context] mask torch's attention needs for the chunk, or None where it
        attends without one: without a window, the chunk after a prefix attends in two
        unmasked parts on the CPU (attention.prefill_attention); elsewhere through one masked
        call. (The prefill kernel computes both limits itself.)"""
        context = entry.start_pos + len(entry.token_ids)
        window = self.config.window_of(context)
        if window is None and (entry.start_pos == 0 or self.device.type == "cpu"):
            return None
        query_positions = torch.arange(entry.start_pos, context)[:, None]
        key_positions = torch.arange(context)[None, :]
        blocked = key_positions > query_positions
        if window is not None:
            blocked |= key_positions <= query_positions - window
        return self._additive_mask(blocked).to(self.device)


def kv_cache_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The zeroed KV cache. On the CPU on huge pages (huge_pages.py): decode attention reads
    each row's blocks scattered over it, 2-3 pages a block on 4 KiB pages (32 rows of 301
    tokens x 30 layers, 2 cores of an AMD EPYC Zen 5, side by side: 12.6 vs 14.8 ms); its
    pages faulted in when it is made, not by the steps that first write them."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    return huge_page_bytes(size, populate=True).view(dtype).view(shape)


# Padding blocks one extra decode group is worth: the group's extra gathers and SDPA call
# cost about as much as gathering and attending this many padding blocks (measured on CPU).
GROUP_COST_IN_BLOCKS = 16


def padding_groups(block_counts: list[int]) -> list[tuple[int, int]]:
    """Split entries sorted by block count (descending) into runs [start, end) minimizing
    padded blocks (run length x its first count) + GROUP_COST_IN_BLOCKS per run.

    Exact dynamic program over the distinct counts (entries with equal counts always share a
    run), so it costs O(distinct^2), not O(entries^2)."""
    values: list[int] = []
    run_ends: list[int] = []  # entries up to and including each distinct value
    for i, count in enumerate(block_counts):
        if values and values[-1] == count:
            run_ends[-1] = i + 1
        else:
            values.append(count)
            run_ends.append(i + 1)
    best = [0] + [math.inf] * len(values)
    first_of_group = [0] * (len(values) + 1)
    for last in range(1, len(values) + 1):
        for first in range(1, last + 1):
            entries_before = run_ends[first - 2] if first > 1 else 0
            padded = values[first - 1] * (run_ends[last - 1] - entries_before)
            cost = best[first - 1] + GROUP_COST_IN_BLOCKS + padded
            if cost < best[last]:
                best[last], first_of_group[last] = cost, first
    groups: list[tuple[int, int]] = []
    last = len(values)
    while last:
        first = first_of_group[last]
        groups.append((run_ends[first - 2] if first > 1 else 0, run_ends[last - 1]))
        last = first - 1
    return groups[::-1]
