"""Byte order of vLLM's KV blocks on the wire, and copying blocks out of / into vLLM's cache.

vLLM's CPU attention keeps one tensor per layer, [num_blocks, num_kv_heads, block_size,
2 * head_dim] in shape, whose memory per block is [kv head][K, V][token][dim]. A block on the
wire covers every layer, in one of two byte orders:

- "vllm": each layer's block memory as vLLM holds it, layer after layer
  ([layer][kv head][K/V][token][dim]); a vLLM-to-vLLM hand-off copies it as is.
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

    def vllm_view(self, layer: torch.Tensor) -> torch.Tensor:
        """[num_blocks, kv heads, K/V, token, dim] view of a layer's cache."""
        return layer.view(layer.shape[0], self.num_kv_heads, 2, self.block_size, self.head_dim)


def pack_blocks(
    layers: Sequence[torch.Tensor], block_ids: Sequence[int], wire_format: str
) -> list[bytes]:
    """The wire bytes of some blocks (every layer), one bytes object per block."""
    _check_format(wire_format)
    shape = BlockShape.of_layer(layers[0])
    index = torch.tensor(list(block_ids), dtype=torch.long)
    # [blocks, layer, kv head, K/V, token, dim]
    stacked = torch.stack([shape.vllm_view(layer).index_select(0, index) for layer in layers], 1)
    if wire_format == "native":
        stacked = stacked.permute(0, 1, 3, 4, 2, 5)  # [blocks, layer, K/V, token, kv head, dim]
    raw = stacked.contiguous().view(len(block_ids), -1).view(torch.uint8)
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
    h, t, d = shape.num_kv_heads, shape.block_size, shape.head_dim
    raw = torch.frombuffer(bytearray(b"".join(blocks)), dtype=torch.uint8).view(layers[0].dtype)
    if wire_format == "native":
        data = raw.view(len(blocks), len(layers), 2, t, h, d).permute(0, 1, 4, 2, 3, 5)
    else:
        data = raw.view(len(blocks), len(layers), h, 2, t, d)
    index = torch.tensor(list(block_ids), dtype=torch.long)
    for number, layer in enumerate(layers):
        shape.vllm_view(layer).index_copy_(0, index, data[:, number].contiguous())


def _check_format(wire_format: str) -> None:
    if wire_format not in WIRE_FORMATS:
        raise ValueError(f"wire format must be one of {WIRE_FORMATS}, got {wire_format!r}")
