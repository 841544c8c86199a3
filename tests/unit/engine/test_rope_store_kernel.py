"""The C RoPE + K/V store kernel against torch's ops (models/llama.apply_rope, index_copy_)."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.models.llama import apply_rope
from services.worker.engine.rope_store_kernel import load_rope_store_kernel

ONE_STEP = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7}
"""Relative spacing of neighbouring values: bfloat16 keeps 7 bits of mantissa."""


# One decode row, a few, and a prefill chunk long enough to be split over threads; a float32
# model's Q/K/V and cache, and a bfloat16 one's (the kernel's build of its own).
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch(
    tokens: int, threads: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Rotated Q/K and the stored K/V are torch's path's within one step of their dtype (the
    kernel may fuse a product into a multiply-add where torch rounds it; in bfloat16 both round
    once, after the float32 rotation); V is copied as is."""
    generator = torch.Generator().manual_seed(tokens * 10 + heads)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=generator).to(dtype)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=generator) * 100
    rotations = torch.polar(torch.ones_like(angles), angles)
    num_slots = tokens + 40
    slots = torch.randperm(num_slots, generator=generator)[:tokens]
    key_slots = torch.randn(num_slots, kv_heads, head_dim, generator=generator).to(dtype)
    value_slots = torch.randn(num_slots, kv_heads, head_dim, generator=generator).to(dtype)

    rotated = apply_rope(qkv[:, : heads + kv_heads], rotations)
    expected_keys, expected_values = key_slots.clone(), value_slots.clone()
    expected_keys.index_copy_(0, slots, rotated[:, heads:])
    expected_values.index_copy_(0, slots, qkv[:, heads + kv_heads :])
    values_before = qkv[:, heads + kv_heads :].clone()

    load_rope_store_kernel(threads, dtype)(qkv, heads, rotations, slots, key_slots, value_slots)

    step = ONE_STEP[dtype]
    torch.testing.assert_close(qkv[:, : heads + kv_heads], rotated, atol=1e-6, rtol=step)
    assert torch.equal(qkv[:, heads + kv_heads :], values_before)  # V is not rotated
    torch.testing.assert_close(key_slots, expected_keys, atol=1e-6, rtol=step)
    assert torch.equal(value_slots, expected_values)  # every other slot untouched


def test_config_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="rope_store must be one of"):
        EngineConfig(rope_store="fused").validate()
