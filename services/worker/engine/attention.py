"""Causal attention over a paged KV cache for a varlen batch (decode tokens + prefill chunks).

The batch's tokens are laid out decode entries first (one token each), then each prefill
chunk as a contiguous run of rows. Decodes are attended in one padded, masked SDPA call; each
prefill chunk gets its own call (its queries would make a padded batch mostly padding).
Per-layer KV cache: one tensor [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk: rows [row_start, row_end) of the batch."""

    row_start: int
    row_end: int
    start_pos: int  # tokens of the sequence already cached before this chunk
    block_table: torch.Tensor  # [blocks covering start_pos + chunk length], long
    # [chunk, context] True where attending is allowed; None when the chunk is the whole
    # context so far (start_pos == 0): plain causal attention over the fresh K/V.
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionBatch:
    slots: torch.Tensor  # [T] flat cache slot (block * block_size + offset) of every token
    num_decode: int  # rows [0, num_decode) are single-token decode entries
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks], padded with block 0
    decode_mask: torch.Tensor  # [num_decode, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSpan]


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store the batch's new K and V [T, kv_heads, dim] into their cache slots."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[rows, blocks] block ids -> [rows, kv_heads, blocks * block_size, dim] (a strided view,
    which SDPA takes as is). index_select copies whole blocks (faster than advanced indexing)."""
    rows, blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    gathered = torch.index_select(cache, 0, block_tables.reshape(-1))
    return gathered.view(rows, blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:
    """q [T, heads, dim], k/v [T, kv_heads, dim] (new tokens) -> attention output [T, heads, dim].

    Writes the new K/V into the cache first, so every query sees its own token."""
    write_kv(kv_cache, k, v, batch.slots)
    outputs: list[torch.Tensor] = []
    if batch.num_decode:
        nd = batch.num_decode
        keys = gather_context(kv_cache[0], batch.decode_block_tables)
        values = gather_context(kv_cache[1], batch.decode_block_tables)
        out = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2), keys, values, attn_mask=batch.decode_mask, enable_gqa=True
        )
        outputs.append(out.squeeze(2))
    for span in batch.prefills:
        rows = slice(span.row_start, span.row_end)
        queries = q[rows].transpose(0, 1).unsqueeze(0)
        if span.mask is None:
            keys = k[rows].transpose(0, 1).unsqueeze(0)
            values = v[rows].transpose(0, 1).unsqueeze(0)
        else:
            context = span.mask.shape[-1]
            table = span.block_table.unsqueeze(0)
            keys = gather_context(kv_cache[0], table)[:, :, :context]
            values = gather_context(kv_cache[1], table)[:, :, :context]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=True
        )
        outputs.append(out.squeeze(0).transpose(0, 1))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
