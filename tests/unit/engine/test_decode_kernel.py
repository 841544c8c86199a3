"""The C paged decode-attention kernel against attention computed the plain way."""

from __future__ import annotations

import math

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.decode_kernel import load_decode_kernel
from tests.unit.engine.paged_reference import BLOCK_SIZE, reference

CPU = torch.device("cpu")


def scattered_tables(
    contexts: list[int], num_blocks: int, generator: torch.Generator
) -> tuple[list[list[int]], torch.Tensor]:
    """Each context's block table over blocks in random order, and the tables padded with block
    0 (which the kernel must not read) into one tensor."""
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for context in contexts:
        blocks = math.ceil(context / BLOCK_SIZE)
        tables.append(order[used : used + blocks])
        used += blocks
    max_blocks = max(map(len, tables))
    return tables, torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])


# A sliding window of 24 tokens (window > 0) starts mid-block and covers 2-3 blocks.
@pytest.mark.parametrize("lone", [False, True])
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("threads", [1, 2])
# Head sizes the kernel unrolls (64, 128) and ones it loops over, one (40) not a whole number
# of vectors; groups of 1-6 query heads, more than one value tile (6 = 4 + 2 on AVX-512).
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (4, 4, 16), (8, 2, 32), (12, 2, 128), (5, 1, 40)],
)
def test_kernel_matches_plain_attention(
    threads: int, heads: int, kv_heads: int, head_dim: int, window: int, lone: bool
) -> None:
    """lone: one row, fewer than the threads, which the kernel splits by KV head."""
    generator = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + threads)
    num_blocks = 64
    keys = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=generator)
    values = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=generator)
    # A context of one token, exact block multiples, one past a multiple, and long ones, over
    # scattered blocks (tables padded with block 0, which the kernel must not read).
    contexts = [250] if lone else [1, 16, 17, 100, 250, 5, 32]
    tables, padded = scattered_tables(contexts, num_blocks, generator)
    q = torch.randn(len(contexts), heads, head_dim, generator=generator)

    kernel = load_decode_kernel(threads)
    got = kernel(q, keys, values, padded, torch.tensor(contexts), window)

    torch.testing.assert_close(
        got, reference(q, keys, values, tables, contexts, window), atol=2e-5, rtol=2e-5
    )


@pytest.mark.parametrize("lone", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (5, 1, 40)])
def test_bfloat16_build_is_the_float32_one_on_the_widened_caches(
    threads: int, heads: int, kv_heads: int, head_dim: int, lone: bool
) -> None:
    """A bfloat16 cache read by its own build: bit for bit the float32 build's output on the
    same caches widened to float32 beforehand (then rounded to q's bfloat16), so a key or value
    misread, or a block missed, shows; and close to plain attention."""
    generator = torch.Generator().manual_seed(heads + threads)
    keys = torch.randn(40, BLOCK_SIZE, kv_heads, head_dim, generator=generator).bfloat16()
    values = torch.randn(40, BLOCK_SIZE, kv_heads, head_dim, generator=generator).bfloat16()
    contexts = [230] if lone else [1, 17, 100, 5, 230]
    tables, padded = scattered_tables(contexts, 40, generator)
    q = torch.randn(len(contexts), heads, head_dim, generator=generator).bfloat16()

    got = load_decode_kernel(threads, torch.bfloat16)(
        q, keys, values, padded, torch.tensor(contexts)
    )
    widened = load_decode_kernel(threads)(
        q.float(), keys.float(), values.float(), padded, torch.tensor(contexts)
    )

    assert got.dtype == torch.bfloat16
    assert torch.equal(got, widened.bfloat16())
    expected = reference(q.float(), keys.float(), values.float(), tables, contexts)
    torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=1e-2)


def test_kernel_takes_a_non_contiguous_query() -> None:
    keys = torch.randn(4, BLOCK_SIZE, 2, 8)
    values = torch.randn(4, BLOCK_SIZE, 2, 8)
    wide = torch.randn(3, 4, 16)
    q = wide[:, :, :8]  # every row strided
    assert not q.is_contiguous()
    tables = [[2, 0], [1, 3], [3, 0]]
    contexts = [20, 32, 3]
    got = load_decode_kernel(1)(q, keys, values, torch.tensor(tables), torch.tensor(contexts))
    torch.testing.assert_close(got, reference(q, keys, values, tables, contexts))


def test_config_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="decode_attention must be one of"):
        EngineConfig(decode_attention="flash").validate()
