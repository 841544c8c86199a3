"""Causal attention over a paged KV cache for a varlen batch (decode tokens + prefill chunks).

The batch's tokens are laid out decode entries first (one token each, longest context first),
then each prefill chunk as a contiguous run of rows. On CPU (float32 or bfloat16), all decodes
go through one call of the C kernel, which reads each row's blocks in place (decode_kernel.py).
Elsewhere they are attended in groups of similar context length, one padded, masked SDPA call
per group (the planner trades padding against calls). Each prefill chunk gets its own attention
(its queries would make a padded batch mostly padding): on CPU the C prefill kernel, which
reads the chunk's whole context through its block table (prefill_kernel.py), all of a step's
chunks in one call of it (SmolLM2-135M on 2 cores of an Intel Xeon with AMX, alternated in
one process, min of 9: a step of eight 128-token prompts 0.97x the time of a call per chunk
in bfloat16, 0.98x in float32; sixteen 64-token prompts 0.93x and 0.98x); without it, on CPU,
a chunk after a cached prefix attends to the prefix
and to itself in two flash-attention calls merged by their log-sum-exps, where one masked call
would compute the masked half too.
Everything that does not change from layer to layer (flat block ids, masks, cache views) is
built once per step or once per runner, to keep the per-layer Python work small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.worker.engine.decode_kernel import DecodeKernel
from services.worker.engine.prefill_kernel import PrefillKernel
from services.worker.engine.rope_store_kernel import RopeStoreKernel


@dataclass(slots=True, frozen=True)
class LayerKvCache:
    """Views of one layer's slice of the KV cache tensor."""

    key_blocks: torch.Tensor  # [num_blocks, block_size, kv_heads, dim]
    value_blocks: torch.Tensor
    key_slots: torch.Tensor  # the same memory as [num_blocks * block_size, kv_heads, dim]
    value_slots: torch.Tensor

    @classmethod
    def of(cls, layer_kv: torch.Tensor) -> LayerKvCache:
        """layer_kv: [2 (K, V), num_blocks, block_size, kv_heads, dim], contiguous."""
        keys, values = layer_kv[0], layer_kv[1]
        slot_shape = (-1, *keys.shape[2:])
        return cls(keys, values, keys.view(slot_shape), values.view(slot_shape))


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk: rows [row_start, row_end) of the batch."""

    row_start: int
    row_end: int
    block_ids: torch.Tensor  # [blocks covering the chunk's whole context], long
    # [chunk, context] additive (0 / -inf) causal mask (sliding window included), or None:
    # then the chunk attends causally to its fresh K/V and, when prefix_len > 0, to the whole
    # prefix before it (see prefill_attention).
    mask: torch.Tensor | None
    prefix_len: int = 0  # tokens of the sequence in the cache before the chunk
    # The C kernel attends the chunk when given (mask is then None: it limits each query to
    # its causal past, and to its last `window` positions when window > 0, the model's
    # sliding window or 0).
    kernel: PrefillKernel | None = None
    window: int = 0
    want_logits: bool = True  # False for a chunk that does not reach its prompt's end


@dataclass(slots=True)
class DecodeGroup:
    """Single-token decode entries at rows [row_start, row_end), attended together."""

    row_start: int
    row_end: int
    # [entries * blocks]: their block tables, padded with block 0 to the group's longest
    block_ids: torch.Tensor
    # [entries, 1, 1, blocks * block_size] additive: 0 for context, -inf for padding
    mask: torch.Tensor


@dataclass(slots=True)
class KernelDecode:
    """Single-token decode entries at rows [0, rows), attended by the C kernel."""

    kernel: DecodeKernel
    block_tables: torch.Tensor  # [rows, max_blocks] int64, padded with block 0
    context_lens: torch.Tensor  # [rows] int64: tokens each row attends to, its own included
    window: int  # > 0: each row attends to its last `window` tokens only (sliding window)

    @property
    def rows(self) -> int:
        return self.context_lens.shape[0]


@dataclass(slots=True)
class AttentionBatch:
    slots: torch.Tensor  # [T] flat cache slot (block * block_size + offset) of every token
    # Rotates each layer's Q/K and writes its K/V into the cache in one pass when given
    # (CPU float32 or bfloat16); torch's ops otherwise (models/llama.py: rotate_and_store).
    rope_store: RopeStoreKernel | None
    # The decode rows go one of two ways: groups for SDPA, or all at once through the kernel.
    decode_groups: list[DecodeGroup]
    kernel_decode: KernelDecode | None
    prefills: list[PrefillSpan]


@dataclass(slots=True, frozen=True)
class LastLayerRows:
    """The rows the model's last layer computes once it has written its K/V: the step's
    decode rows and the last row of each prefill chunk that reaches its prompt's end. Nothing
    reads the other rows' output (their tokens' K/V is all a later step needs), so their
    attention, output projection and MLP there are skipped: for a 1,024-token prompt on a
    30-layer model, about a thirtieth of the step."""

    rows: torch.Tensor  # [kept] the kept rows of the step, ascending (decode rows first)
    attention: AttentionBatch  # the kept rows' attention, each chunk's last query alone
    logit_rows: torch.Tensor  # the step's logit rows (caller's entry order) among the kept


def last_layer_rows(batch: AttentionBatch, logit_rows: list[int]) -> LastLayerRows | None:
    """The last layer's rows for `batch`; logit_rows: rows of the step whose logits are
    returned. None for a step without prefill chunks (it keeps every row; a chunk has two rows
    or more, so a step with one always keeps fewer: decode_layers.c keys on the same)."""
    if not batch.prefills:
        return None
    num_decode = batch.prefills[0].row_start
    wanted = [span for span in batch.prefills if span.want_logits]
    rows = [*range(num_decode), *(span.row_end - 1 for span in wanted)]
    device = batch.slots.device
    kept = torch.tensor(rows, dtype=torch.long).to(device)
    index_of_row = {row: i for i, row in enumerate(rows)}
    attention = AttentionBatch(
        slots=batch.slots[kept],
        rope_store=batch.rope_store,
        decode_groups=batch.decode_groups,
        kernel_decode=batch.kernel_decode,
        prefills=[_last_query(span, num_decode + i) for i, span in enumerate(wanted)],
    )
    return LastLayerRows(
        rows=kept,
        attention=attention,
        logit_rows=torch.tensor([index_of_row[r] for r in logit_rows], dtype=torch.long).to(device),
    )


def _last_query(span: PrefillSpan, row: int) -> PrefillSpan:
    """`span`'s last query alone, at `row`: it sits after the chunk's other tokens, whose K/V
    the layer has written."""
    chunk = span.row_end - span.row_start
    return PrefillSpan(
        row_start=row,
        row_end=row + 1,
        block_ids=span.block_ids,
        mask=None if span.mask is None else span.mask[-1:],
        prefix_len=span.prefix_len + chunk - 1,
        kernel=span.kernel,
        window=span.window,
    )


def gather_context(blocks: torch.Tensor, block_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """Flat block ids of `rows` equal-length tables -> [rows, kv_heads, tokens, dim], a strided
    view SDPA takes as is. index_select copies whole blocks (faster than advanced indexing)."""
    gathered = torch.index_select(blocks, 0, block_ids)
    return gathered.view(rows, -1, blocks.shape[2], blocks.shape[3]).transpose(1, 2)


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: LayerKvCache, batch: AttentionBatch) -> None:
    """The step's new K/V [T, kv_heads, dim] into their cache slots."""
    cache.key_slots.index_copy_(0, batch.slots, k)
    cache.value_slots.index_copy_(0, batch.slots, v)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKvCache, batch: AttentionBatch
) -> torch.Tensor:
    """q [T, heads, dim], k/v [T, kv_heads, dim] (new tokens) -> attention output [T, heads, dim].

    The new K/V must be in the cache already (store_kv), so every query sees its own token."""
    outputs: list[torch.Tensor] = []
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if (decode := batch.kernel_decode) is not None:
        outputs.append(
            decode.kernel(
                q[: decode.rows],
                cache.key_blocks,
                cache.value_blocks,
                decode.block_tables,
                decode.context_lens,
                decode.window,
            )
        )
    for group in batch.decode_groups:
        entries = group.row_end - group.row_start
        keys = gather_context(cache.key_blocks, group.block_ids, entries)
        values = gather_context(cache.value_blocks, group.block_ids, entries)
        # One query token per entry: the query heads sharing a KV head become that KV head's
        # query rows (GQA without expanding K/V; measured ~40% faster than enable_gqa).
        queries = q[group.row_start : group.row_end].view(entries, num_kv_heads, -1, head_dim)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask)
        outputs.append(out.reshape(entries, -1, head_dim))
    if (kernel := chunks_kernel(batch.prefills)) is not None:
        spans = batch.prefills
        outputs.append(
            kernel.chunks(
                q[spans[0].row_start : spans[-1].row_end],
                cache.key_blocks,
                cache.value_blocks,
                [span.row_end - span.row_start for span in spans],
                [span.prefix_len for span in spans],
                [span.block_ids for span in spans],
                spans[0].window,
            )
        )
    else:
        outputs += [prefill_attention(q, k, v, cache, span) for span in batch.prefills]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


def chunks_kernel(spans: list[PrefillSpan]) -> PrefillKernel | None:
    """The kernel that attends all of a step's chunks in one call, where there are several
    and one kernel attends them all with one window (the runner plans them so, one after
    another); else None: a call per chunk."""
    kernel = spans[0].kernel if len(spans) > 1 else None
    if kernel is None or any(s.kernel is not kernel or s.window != spans[0].window for s in spans):
        return None
    return kernel


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKvCache, span: PrefillSpan
) -> torch.Tensor:
    """One prefill chunk's attention output [chunk, heads, dim].

    A chunk after a prefix without a mask is two flash-attention calls, the chunk against the
    prefix (every query sees every prefix key) and against its own K/V (causal), merged by
    their log-sum-exps: one call with a [chunk, context] mask would compute every masked
    score too and read the mask (measured: the second 512-token chunk of a 1,024-token
    prompt spent a third of its step in that call)."""
    rows = slice(span.row_start, span.row_end)
    if span.kernel is not None:
        return span.kernel(
            q[rows],
            cache.key_blocks,
            cache.value_blocks,
            span.block_ids,
            span.prefix_len,
            span.window,
        )
    queries = q[rows].transpose(0, 1).unsqueeze(0)
    own_keys = k[rows].transpose(0, 1).unsqueeze(0)
    own_values = v[rows].transpose(0, 1).unsqueeze(0)
    # A chunk's last query alone (LastLayerRows) without a mask sees its whole context.
    alone = span.row_end - span.row_start == 1
    if span.mask is not None or alone:
        context = span.prefix_len + 1 if span.mask is None else span.mask.shape[-1]
        keys = gather_context(cache.key_blocks, span.block_ids, 1)[:, :, :context]
        values = gather_context(cache.value_blocks, span.block_ids, 1)[:, :, :context]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=span.mask, enable_gqa=True
        )
    elif span.prefix_len == 0:
        out = F.scaled_dot_product_attention(
            queries, own_keys, own_values, is_causal=True, enable_gqa=True
        )
    else:
        prefix = span.prefix_len
        keys = gather_context(cache.key_blocks, span.block_ids, 1)[:, :, :prefix]
        values = gather_context(cache.value_blocks, span.block_ids, 1)[:, :, :prefix]
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        before, before_lse = flash(queries, keys, values, 0.0, False)
        out, own_lse = flash(queries, own_keys, own_values, 0.0, True)
        # softmax over both parts = each part's softmax weighted by its share of the total
        # exp-sum: sigmoid(lse_before - lse_own) for the prefix part.
        share = torch.sigmoid(before_lse - own_lse).unsqueeze(-1).to(out.dtype)
        out = out.add_(before.sub_(out).mul_(share))
    return out.squeeze(0).transpose(0, 1)
