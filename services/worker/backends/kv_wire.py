"""Byte order of vLLM's KV blocks on the wire, and copying blocks out of / into vLLM's cache.

vLLM's CPU attention keeps one tensor per layer, [num_blocks, num_kv_heads, block_size,
2 * head_dim] in shape. Its kernels (the "vec" ISA, used for blocks of a multiple of 32
tokens without AMX) fill each head's slice of a block with the keys transposed, [dim][token],
then the values, [token][dim]. A block on the wire covers every layer, in one of two byte orders:

- "vllm": each layer's block memory exactly as vLLM holds it, layer after layer; a
  vLLM-to-vLLM hand-off copies it as is.
- "native": kvmesh's own engine's order ([layer][K/V][token][kv head][dim], see
  ModelRunner.read_block), so blocks move between vLLM and native workers when dtype,
  block size and model shape agree too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

WIRE_FORMATS = ("vllm", "native")


@dataclass(slots=True, frozen=True)
class BlockShape:
    """Shape of one layer's slice of one block."""

    num_kv_heads: int
    block_size: int
    head_dim: int

    @classmethod
    def of_layer(cls, layer: torch.Tensor) -> BlockShape:
        """The shape from a vLLM CPU cache tensor [num_blocks, kv heads, block size, 2 * dim]."""
        if layer.dim() != 4 or layer.shape[3] % 2:
            raise ValueError(f"unexpected vLLM KV cache shape {tuple(layer.shape)}")
        return cls(layer.shape[1], layer.shape[2], layer.shape[3] // 2)

    @property
    def half(self) -> int:
        """Elements of the keys (or the values) of one head in one block."""
        return self.block_size * self.head_dim

    def heads_view(self, layer: torch.Tensor) -> torch.Tensor:
        """[num_blocks, kv heads, keys then values] view of a layer's cache."""
        return layer.view(layer.shape[0], self.num_kv_heads, 2 * self.half)


def pack_blocks(
    layers: Sequence[torch.Tensor], block_ids: Sequence[int], wire_format: str
) -> list[bytes]:
    """The wire bytes of some blocks (every layer), one bytes object per block."""
    _check_format(wire_format)
    shape = BlockShape.of_layer(layers[0])
    index = torch.tensor(list(block_ids), dtype=torch.long)
    per_layer = [shape.heads_view(layer).index_select(0, index) for layer in layers]
    if wire_format == "native":
        per_layer = [_to_native(blocks, shape) for blocks in per_layer]
    raw = torch.stack(per_layer, 1).contiguous().view(len(block_ids), -1).view(torch.uint8)
    return [raw[i].numpy().tobytes() for i in range(len(block_ids))]


def unpack_blocks(
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    blocks: Sequence[bytes],
    wire_format: str,
) -> None:
    """Write wire blocks into vLLM's cache at `block_ids` (inverse of pack_blocks)."""
    _check_format(wire_format)
    if len(blocks) != len(block_ids):
        raise ValueError(f"{len(blocks)} blocks for {len(block_ids)} block ids")
    if not blocks:
        return
    shape = BlockShape.of_layer(layers[0])
    raw = torch.frombuffer(bytearray(b"".join(blocks)), dtype=torch.uint8).view(layers[0].dtype)
    per_block = raw.view(len(blocks), len(layers), -1)
    index = torch.tensor(list(block_ids), dtype=torch.long)
    for number, layer in enumerate(layers):
        data = per_block[:, number]
        if wire_format == "native":
            data = _from_native(data, shape)
        shape.heads_view(layer).index_copy_(
            0, index, data.reshape(len(blocks), shape.num_kv_heads, -1)
        )


def _to_native(blocks: torch.Tensor, shape: BlockShape) -> torch.Tensor:
    """[n, heads, K^T then V] (vLLM) -> [n, K/V, token, head, dim] (native)."""
    n, h, t, d = blocks.shape[0], shape.num_kv_heads, shape.block_size, shape.head_dim
    keys = blocks[:, :, : shape.half].reshape(n, h, d, t).permute(0, 3, 1, 2)
    values = blocks[:, :, shape.half :].reshape(n, h, t, d).permute(0, 2, 1, 3)
    return torch.stack([_pairs_adjacent(keys), values], 1)


def _pairs_adjacent(keys: torch.Tensor) -> torch.Tensor:
    """Hugging Face rotary order (first halves, then second halves) -> the native engine's
    interleaved pair order along the last dim (it keeps its Q/K projections that way)."""
    *lead, d = keys.shape
    return keys.reshape(*lead, 2, d // 2).transpose(-1, -2).reshape(*lead, d)


def _halves_apart(keys: torch.Tensor) -> torch.Tensor:
    """Inverse of _pairs_adjacent."""
    *lead, d = keys.shape
    return keys.reshape(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)


def _from_native(blocks: torch.Tensor, shape: BlockShape) -> torch.Tensor:
    """[n, K/V, token, head, dim] (native, flat) -> [n, heads, K^T then V] (vLLM)."""
    n, h, t, d = blocks.shape[0], shape.num_kv_heads, shape.block_size, shape.head_dim
    native = blocks.reshape(n, 2, t, h, d)
    keys = _halves_apart(native[:, 0]).permute(0, 2, 3, 1).reshape(n, h, shape.half)
    values = native[:, 1].permute(0, 2, 1, 3).reshape(n, h, shape.half)
    return torch.cat([keys, values], 2)


def _check_format(wire_format: str) -> None:
    if wire_format not in WIRE_FORMATS:
        raise ValueError(f"wire format must be one of {WIRE_FORMATS}, got {wire_format!r}")
