"""Blocks out of and into vLLM's CPU cache layout, in vLLM's and the native byte order."""

from __future__ import annotations

import pytest
import torch

from services.worker.backends.kv_wire import pack_blocks, unpack_blocks

LAYERS, BLOCKS, HEADS, TOKENS, DIM = 2, 5, 3, 4, 2


def vllm_layers_from_native(native: torch.Tensor) -> list[torch.Tensor]:
    """vLLM CPU caches holding the KV of `native` [layer, K/V, block, token, head, dim]:
    per block and head, the keys as [dim][token], then the values as [token][dim]."""
    layers = []
    for layer in range(LAYERS):
        keys = native[layer, 0].permute(0, 2, 3, 1).reshape(BLOCKS, HEADS, TOKENS * DIM)
        values = native[layer, 1].permute(0, 2, 1, 3).reshape(BLOCKS, HEADS, TOKENS * DIM)
        heads = torch.cat([keys, values], 2)
        layers.append(heads.reshape(BLOCKS, HEADS, TOKENS, 2 * DIM).contiguous())
    return layers


@pytest.fixture
def native() -> torch.Tensor:
    return torch.arange(LAYERS * 2 * BLOCKS * TOKENS * HEADS * DIM, dtype=torch.float32).reshape(
        LAYERS, 2, BLOCKS, TOKENS, HEADS, DIM
    )


def test_native_format_is_the_native_engines_block_bytes(native: torch.Tensor) -> None:
    layers = vllm_layers_from_native(native)
    packed = pack_blocks(layers, [3, 1], "native")
    # The native engine's read_block: kv_cache[:, :, block] of [layer, K/V, block, token, ...].
    assert packed == [native[:, :, b].contiguous().numpy().tobytes() for b in (3, 1)]


@pytest.mark.parametrize("wire_format", ["vllm", "native"])
def test_unpack_inverts_pack(native: torch.Tensor, wire_format: str) -> None:
    source = vllm_layers_from_native(native)
    packed = pack_blocks(source, [0, 4], wire_format)
    target = [torch.zeros_like(layer) for layer in source]
    unpack_blocks(target, [2, 3], packed, wire_format)
    for src, dst in zip(source, target, strict=True):
        assert torch.equal(dst[2], src[0])
        assert torch.equal(dst[3], src[4])
        assert not dst[[0, 1]].any()


def test_unknown_format_is_refused(native: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="wire format"):
        pack_blocks(vllm_layers_from_native(native), [0], "gguf")
