"""The C paged prefill-attention kernel against attention computed the plain way.

Query i of a chunk after `prefix` cached tokens attends exactly as a decode row whose context
is its own position: the plain reference of the decode kernel's tests gives the answer."""

from __future__ import annotations

import math

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.kernel_build import cpu_has_amx
from services.worker.engine.prefill_kernel import load_prefill_kernel
from tests.unit.engine.paged_reference import BLOCK_SIZE, reference


def paged_context(
    generator: torch.Generator, context: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Random key and value blocks with spare blocks around, and a scattered block table."""
    num_blocks = math.ceil(context / BLOCK_SIZE) + 6
    keys = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=generator)
    values = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=generator)
    table = torch.randperm(num_blocks, generator=generator)[: math.ceil(context / BLOCK_SIZE)]
    return keys, values, table.tolist()


def expected(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: list[int],
    prefix: int,
    window: int,
    probabilities: torch.dtype | None = None,
) -> torch.Tensor:
    chunk = q.shape[0]
    contexts = [prefix + i + 1 for i in range(chunk)]
    return reference(q, keys, values, [table] * chunk, contexts, window, probabilities)


# Chunks shorter than a query tile (32) and longer than several, after no prefix, a prefix
# ending mid-block and one longer than a key tile (64); windows that start mid-block, one
# shorter than the chunk and one longer than the whole context.
@pytest.mark.parametrize(
    ("prefix", "chunk", "window"),
    [(0, 1, 0), (0, 37, 0), (0, 150, 0), (21, 50, 0), (130, 70, 0), (40, 100, 24), (0, 70, 500)],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 16), (8, 2, 32), (4, 2, 8)]
)
def test_kernel_matches_plain_attention(
    threads: int, heads: int, kv_heads: int, head_dim: int, prefix: int, chunk: int, window: int
) -> None:
    generator = torch.Generator().manual_seed(prefix * 1000 + chunk * 10 + heads)
    keys, values, table = paged_context(generator, prefix + chunk, kv_heads, head_dim)
    # The query heads as the runner hands them over: the first heads of each fused Q/K row.
    fused = torch.randn(chunk, heads + kv_heads, head_dim, generator=generator)
    q = fused[:, :heads]
    assert q.stride(0) == (heads + kv_heads) * head_dim  # rows strided

    got = load_prefill_kernel(threads)(q, keys, values, torch.tensor(table), prefix, window)

    torch.testing.assert_close(
        got, expected(q, keys, values, table, prefix, window), atol=2e-5, rtol=2e-5
    )


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("prefix", "chunk", "window"), [(0, 150, 0), (130, 70, 0), (40, 100, 24)])
def test_bfloat16_build_is_the_float32_one_on_the_widened_caches(
    threads: int, prefix: int, chunk: int, window: int
) -> None:
    """A bfloat16 cache read by its widening build: bit for bit the float32 build's output on
    the same caches and queries widened to float32 beforehand (then rounded to q's bfloat16),
    so a key or value misread, or a block missed, shows; and close to plain attention."""
    generator = torch.Generator().manual_seed(prefix + chunk + threads)
    keys, values, table = paged_context(generator, prefix + chunk, 3, 64)
    keys, values = keys.bfloat16(), values.bfloat16()
    q = torch.randn(chunk, 12, 64, generator=generator).bfloat16()[:, :9]  # rows strided
    blocks = torch.tensor(table)

    kernel = load_prefill_kernel(threads, torch.bfloat16, pairs=False)
    assert not kernel.pairs and not kernel.tiles
    got = kernel(q, keys, values, blocks, prefix, window)
    widened = load_prefill_kernel(threads)(
        q.float(), keys.float(), values.float(), blocks, prefix, window
    )

    assert got.dtype == torch.bfloat16
    assert torch.equal(got, widened.bfloat16())
    reference_out = expected(q.float(), keys.float(), values.float(), table, prefix, window)
    torch.testing.assert_close(got.float(), reference_out, atol=1e-2, rtol=1e-2)


# Odd head_dim: the last pair of each query and key is padded with a zero (and with AMX tiles
# to 16 pairs); head_dim 128: the AMX build's sums in two sets of four tiles.
@pytest.mark.parametrize("tiles", [False, True], ids=["vectors", "amx"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("prefix", "chunk", "window", "head_dim"),
    [
        (0, 150, 0, 64),
        (130, 70, 0, 64),
        (40, 100, 24, 64),
        (1000, 32, 0, 64),
        (21, 50, 0, 15),
        (70, 40, 0, 128),
    ],
)
def test_bfloat16_pairs_build_rounds_only_the_probabilities(
    tiles: bool, threads: int, prefix: int, chunk: int, window: int, head_dim: int
) -> None:
    """The builds that multiply bfloat16 pairs, on AVX-512 BF16 vectors or on AMX tiles:
    plain attention on the same bfloat16 inputs with each softmax numerator rounded to
    bfloat16 before it weighs the values, within bfloat16's rounding of them and of the
    output (a probability is rounded against the running max, the reference's against the
    final one), and on average far closer, so that a key or value misread shows."""
    kernel = load_prefill_kernel(threads, torch.bfloat16, pairs=True, tiles=tiles)
    if not kernel.pairs:
        pytest.skip("no AVX-512 BF16 here: the pairs build widens")
    if tiles and not kernel.tiles:
        pytest.skip("no AMX here: the AMX_TILES build multiplies pairs on vectors")
    generator = torch.Generator().manual_seed(prefix + chunk + threads + head_dim)
    keys, values, table = paged_context(generator, prefix + chunk, 3, head_dim)
    keys, values = keys.bfloat16(), values.bfloat16()
    q = torch.randn(chunk, 12, head_dim, generator=generator).bfloat16()[:, :9]  # rows strided

    got = kernel(q, keys, values, torch.tensor(table), prefix, window)

    assert got.dtype == torch.bfloat16
    rounded = expected(
        q.float(), keys.float(), values.float(), table, prefix, window, torch.bfloat16
    ).bfloat16()
    torch.testing.assert_close(got, rounded, atol=1e-2, rtol=1e-2)
    assert (got.float() - rounded.float()).abs().mean() < 1e-3


def test_query_tiles_do_not_change_the_numbers() -> None:
    """A 32-token chunk after a long prefix goes in smaller query tiles the more threads
    there are to keep busy (1 thread: 16 positions a tile, 2: 8); each query's output is the
    same bit for bit either way, and right."""
    generator = torch.Generator().manual_seed(3)
    keys, values, table = paged_context(generator, 1032, 3, 64)
    q = torch.randn(32, 9, 64, generator=generator)
    blocks = torch.tensor(table)

    alone, shared = (load_prefill_kernel(t)(q, keys, values, blocks, 1000) for t in (1, 2))

    assert torch.equal(alone, shared)
    torch.testing.assert_close(
        shared, expected(q, keys, values, table, 1000, 0), atol=2e-5, rtol=2e-5
    )


def test_large_scores_stay_finite_and_exact() -> None:
    """Scores past e^x's float range (std ~25, max > 88: a running max that jumps from tile
    to tile) neither overflow nor lose accuracy; fp32 scores this large carry ~3e-5 of
    rounding in the reference too, hence the looser tolerance."""
    generator = torch.Generator().manual_seed(7)
    keys, values, table = paged_context(generator, 200, 1, 16)
    keys *= 5
    q = torch.randn(200, 2, 16, generator=generator) * 5
    scores = torch.einsum("qhd,kd->qhk", q, keys.reshape(-1, 16)) / 4
    assert scores.max() > 88
    got = load_prefill_kernel(2)(q, keys, values, torch.tensor(table), 0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected(q, keys, values, table, 0, 0), atol=1e-4, rtol=1e-4)


def test_config_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="prefill_attention must be one of"):
        EngineConfig(prefill_attention="flash").validate()


def test_bfloat16_caches_take_amx_tiles_where_the_cpu_has_them() -> None:
    """By default a bfloat16 cache's kernel multiplies on AMX tiles exactly where the CPU
    has AMX-BF16 (Linux grants the tiles to any process that asks), and then in pairs."""
    kernel = load_prefill_kernel(2, torch.bfloat16)
    assert kernel.tiles == cpu_has_amx()
    assert kernel.pairs or not kernel.tiles
    assert not load_prefill_kernel(2).tiles


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_steps_chunks_in_one_call_are_the_calls_per_chunk(
    threads: int, dtype: torch.dtype, window: int
) -> None:
    """Chunks of one step (lengths 1 to 150, after no prefix, a prefix mid-block and one of
    several key tiles, each through its own scattered blocks) attended in one call: bit for
    bit what a call per chunk gives (the default build for the dtype), rows in order."""
    generator = torch.Generator().manual_seed(threads + window)
    chunks = [(0, 37), (21, 50), (130, 70), (0, 1), (300, 150), (5, 8)]  # (prefix, length)
    keys = torch.randn(200, BLOCK_SIZE, 3, 64, generator=generator).to(dtype)
    values = torch.randn(200, BLOCK_SIZE, 3, 64, generator=generator).to(dtype)
    order = torch.randperm(200, generator=generator)
    tables, used = [], 0
    for prefix, length in chunks:
        blocks = math.ceil((prefix + length) / BLOCK_SIZE)
        tables.append(order[used : used + blocks])
        used += blocks
    rows = sum(length for _, length in chunks)
    q = torch.randn(rows, 12, 64, generator=generator).to(dtype)[:, :9]  # rows strided
    kernel = load_prefill_kernel(threads, dtype)

    together = kernel.chunks(
        q, keys, values, [n for _, n in chunks], [p for p, _ in chunks], tables, window
    )

    apart, row = [], 0
    for (prefix, length), table in zip(chunks, tables, strict=True):
        apart.append(kernel(q[row : row + length], keys, values, table, prefix, window))
        row += length
    assert together.dtype == dtype
    assert torch.equal(together, torch.cat(apart))
