"""ModelRunner against Hugging Face transformers on the tiny random Llama (fp32)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

from services.worker.engine.attention import AttentionBatch, PrefillSpan, last_layer_rows
from services.worker.engine.decode_kernel import load_decode_kernel
from services.worker.engine.huge_pages import HUGE_PAGE_BYTES
from services.worker.engine.linear_kernel import load_linear_kernel
from services.worker.engine.loader import LoadedModel, load_model
from services.worker.engine.model_runner import (
    GROUP_COST_IN_BLOCKS,
    BatchEntry,
    ModelRunner,
    padding_groups,
)
from services.worker.engine.models.llama import project_with_torch
from services.worker.engine.prefill_kernel import load_prefill_kernel
from services.worker.engine.rope_store_kernel import load_rope_store_kernel

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(params=["torch", "kernels+torch", "kernels+onednn", "kernels+panels"])
def kernels(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Every way a CPU step runs: torch alone (SDPA decode groups, flash-attention prefill,
    RoPE and K/V stores as torch ops, torch matmuls), the C kernels (paged decode and prefill
    attention, RoPE with the K/V store, small-batch projections) with torch's matmul for
    larger steps, with oneDNN on reordered weights for them, and with the panel kernel."""
    if request.param == "torch":
        return {}
    threads = torch.get_num_threads()
    return {
        "decode_kernel": load_decode_kernel(threads),
        "prefill_kernel": load_prefill_kernel(threads),
        "rope_store_kernel": load_rope_store_kernel(threads),
        "linear_kernel": load_linear_kernel(threads, request.param.removeprefix("kernels+")),
    }


def hf_logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] logits of a full, uncached forward pass."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def sequence(seed: int, length: int, vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


def test_mixed_batch_with_chunked_prefill_matches_hf(
    tiny_loaded: LoadedModel, tiny_hf: LlamaForCausalLM, kernels: dict[str, Any]
) -> None:
    vocab = tiny_loaded.config.vocab_size
    runner = ModelRunner(tiny_loaded, num_blocks=40, block_size=BLOCK_SIZE, **kernels)
    # Scattered, interleaved block ids so a wrong slot mapping cannot go unnoticed.
    tables = {"a": [7, 3, 30, 12], "b": [1, 25, 9, 18, 33, 4, 21, 15], "c": [38, 2]}
    seqs = {"a": sequence(1, 40, vocab), "b": sequence(2, 100, vocab), "c": sequence(3, 7, vocab)}
    next_tokens = {name: sequence(10 + i, 3, vocab) for i, name in enumerate(seqs)}

    # Step 1: a and c prefill whole, b's prompt split: first 60 tokens, no logits wanted.
    step1 = runner.forward(
        [
            BatchEntry(seqs["a"], 0, tables["a"]),
            BatchEntry(seqs["b"][:60], 0, tables["b"], want_logits=False),
            BatchEntry(seqs["c"], 0, tables["c"]),
        ]
    )
    assert step1.shape == (2, vocab) and step1.dtype == torch.float32
    torch.testing.assert_close(step1[0], hf_logits(tiny_hf, seqs["a"])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step1[1], hf_logits(tiny_hf, seqs["c"])[-1], atol=1e-4, rtol=1e-4)

    # Step 2: decodes of a and c around b's second chunk (starting mid-block at 60).
    step2 = runner.forward(
        [
            BatchEntry([next_tokens["a"][0]], 40, tables["a"]),
            BatchEntry(seqs["b"][60:], 60, tables["b"]),
            BatchEntry([next_tokens["c"][0]], 7, tables["c"]),
        ]
    )
    expected2 = [
        hf_logits(tiny_hf, seqs["a"] + next_tokens["a"][:1])[-1],
        hf_logits(tiny_hf, seqs["b"])[-1],
        hf_logits(tiny_hf, seqs["c"] + next_tokens["c"][:1])[-1],
    ]
    torch.testing.assert_close(step2, torch.stack(expected2), atol=1e-4, rtol=1e-4)

    # Step 3: every sequence decodes; b crosses into its 7th block.
    step3 = runner.forward(
        [
            BatchEntry([next_tokens["b"][0]], 100, tables["b"]),
            BatchEntry([next_tokens["a"][1]], 41, tables["a"]),
            BatchEntry([next_tokens["c"][1]], 8, tables["c"]),
        ]
    )
    expected3 = [
        hf_logits(tiny_hf, seqs["b"] + next_tokens["b"][:1])[-1],
        hf_logits(tiny_hf, seqs["a"] + next_tokens["a"][:2])[-1],
        hf_logits(tiny_hf, seqs["c"] + next_tokens["c"][:2])[-1],
    ]
    torch.testing.assert_close(step3, torch.stack(expected3), atol=1e-4, rtol=1e-4)


def test_the_last_layer_computes_past_its_kv_only_the_rows_whose_logits_are_wanted(
    tiny_loaded: LoadedModel, tiny_hf: LlamaForCausalLM
) -> None:
    vocab = tiny_loaded.config.vocab_size
    rows_by_projection: list[tuple[nn.Module, int]] = []

    def counted(module: nn.Module, x: torch.Tensor, **options: Any) -> torch.Tensor:
        rows_by_projection.append((module, x.shape[0]))
        return project_with_torch(module, x, **options)

    runner = ModelRunner(tiny_loaded, num_blocks=16, block_size=BLOCK_SIZE, project=counted)
    a, b, c = sequence(1, 20, vocab), sequence(2, 30, vocab), sequence(3, 9, vocab)
    runner.forward([BatchEntry(a, 0, [0, 1])])
    rows_by_projection.clear()
    # Rows: a's decode (0), b's first 25 tokens (1-25, no logits), c's whole prompt (26-34).
    logits = runner.forward(
        [
            BatchEntry(c, 0, [5]),
            BatchEntry(b[:25], 0, [2, 3], want_logits=False),
            BatchEntry(a[:1], 20, [0, 1]),
        ]
    )
    last = tiny_loaded.model.decoder_layers()[-1]
    first = tiny_loaded.model.decoder_layers()[0]
    assert [rows for module, rows in rows_by_projection if module is first.o_proj] == [35]
    assert [rows for module, rows in rows_by_projection if module is last.qkv_proj] == [35]
    for projection in (last.o_proj, last.gate_up_proj, last.down_proj):
        assert [rows for module, rows in rows_by_projection if module is projection] == [2]
    expected = [hf_logits(tiny_hf, c)[-1], hf_logits(tiny_hf, [*a, a[0]])[-1]]
    torch.testing.assert_close(logits, torch.stack(expected), atol=1e-4, rtol=1e-4)
    # b's last-layer K/V was written for all 25 rows: its next chunk reads it.
    rest = runner.forward([BatchEntry(b[25:], 25, [2, 3])])
    torch.testing.assert_close(rest[0], hf_logits(tiny_hf, b)[-1], atol=1e-4, rtol=1e-4)


def test_last_layer_rows_keep_decodes_and_each_final_chunks_last_query() -> None:
    spans = [
        PrefillSpan(2, 12, torch.tensor([4]), None, want_logits=False),
        PrefillSpan(12, 20, torch.tensor([6, 7]), None, prefix_len=16),
        PrefillSpan(20, 26, torch.tensor([9]), torch.zeros(6, 6)),
    ]
    batch = AttentionBatch(torch.arange(26), None, [], None, spans)
    # Caller's order: the second chunk, decode row 1, the third chunk, decode row 0.
    kept = last_layer_rows(batch, [19, 1, 25, 0])
    assert kept is not None
    assert kept.rows.tolist() == [0, 1, 19, 25]
    assert kept.logit_rows.tolist() == [2, 1, 3, 0]
    assert kept.attention.slots.tolist() == [0, 1, 19, 25]
    second, third = kept.attention.prefills
    assert (second.row_start, second.row_end, second.prefix_len) == (2, 3, 23)
    assert second.block_ids.tolist() == [6, 7] and second.mask is None
    assert (third.row_start, third.row_end, third.prefix_len) == (3, 4, 5)
    assert third.mask is not None and third.mask.shape == (1, 6)
    decodes_only = AttentionBatch(torch.arange(3), None, [], None, [])
    assert last_layer_rows(decodes_only, [2, 0, 1]) is None


def test_prompt_split_into_many_chunks_matches_one_prefill(tiny_loaded: LoadedModel) -> None:
    tokens = sequence(4, 50, tiny_loaded.config.vocab_size)
    table = [5, 0, 6, 2]
    whole = ModelRunner(tiny_loaded, num_blocks=8).forward([BatchEntry(tokens, 0, table)])
    chunked_runner = ModelRunner(tiny_loaded, num_blocks=8)
    for start in range(0, 45, 9):
        assert chunked_runner.forward(
            [BatchEntry(tokens[start : start + 9], start, table, want_logits=False)]
        ).shape == (0, tiny_loaded.config.vocab_size)
    chunked = chunked_runner.forward([BatchEntry(tokens[45:], 45, table)])
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


def test_blocks_round_trip_between_runners(tiny_loaded: LoadedModel) -> None:
    vocab = tiny_loaded.config.vocab_size
    prompt, follow = sequence(5, 37, vocab), sequence(6, 1, vocab)
    source = ModelRunner(tiny_loaded, num_blocks=6)
    source.forward([BatchEntry(prompt, 0, [4, 1, 3])])
    expected = source.forward([BatchEntry(follow, 37, [4, 1, 3])])

    target = ModelRunner(tiny_loaded, num_blocks=10)
    assert source.layout == target.layout
    block_bytes = ModelRunner.bytes_per_block(tiny_loaded.config, torch.float32, BLOCK_SIZE)
    assert source.layout.block_bytes == block_bytes
    for src_block, dst_block in [(4, 8), (1, 0), (3, 5)]:
        data = source.read_block(src_block)
        assert len(data) == block_bytes
        target.write_block(dst_block, data)
        assert target.read_block(dst_block) == data
    # The follow-up token was written into block 3 by `source`; recompute it on the target.
    got = target.forward([BatchEntry(follow, 37, [8, 0, 5])])
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_the_cpu_kv_cache_starts_zeroed_on_a_huge_page(tiny_loaded: LoadedModel) -> None:
    runner = ModelRunner(tiny_loaded, num_blocks=3)
    config = tiny_loaded.config
    assert runner.kv_cache.shape == (
        config.num_layers,
        2,
        3,
        BLOCK_SIZE,
        config.num_kv_heads,
        config.head_dim,
    )
    assert runner.kv_cache.dtype == tiny_loaded.dtype and runner.kv_cache.is_contiguous()
    assert runner.kv_cache.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not runner.kv_cache.any()


def test_write_block_rejects_wrong_size_and_bad_ids(tiny_loaded: LoadedModel) -> None:
    runner = ModelRunner(tiny_loaded, num_blocks=2)
    with pytest.raises(ValueError, match="bytes"):
        runner.write_block(0, b"\x00" * (runner.layout.block_bytes - 1))
    with pytest.raises(ValueError, match="block id"):
        runner.read_block(2)


def test_forward_rejects_a_block_table_too_short(tiny_loaded: LoadedModel) -> None:
    runner = ModelRunner(tiny_loaded, num_blocks=4)
    with pytest.raises(ValueError, match="block table"):
        runner.forward([BatchEntry(list(range(17)), 0, [0])])


@pytest.mark.parametrize("block_id", [-1, 4])
def test_forward_rejects_a_block_id_outside_the_cache(
    tiny_loaded: LoadedModel, block_id: int
) -> None:
    runner = ModelRunner(tiny_loaded, num_blocks=4)
    with pytest.raises(ValueError, match="outside"):
        runner.forward([BatchEntry(list(range(20)), 0, [0, block_id])])
    assert not runner.kv_cache.any()


def test_decodes_of_very_different_lengths_match_hf(
    tiny_loaded: LoadedModel, tiny_hf: LlamaForCausalLM, kernels: dict[str, Any]
) -> None:
    """Short and long contexts in one step: separate padding groups for SDPA, one kernel call
    reading each row's own blocks otherwise."""
    vocab = tiny_loaded.config.vocab_size
    lengths = [5, 300, 12, 290]
    seqs = [sequence(20 + i, n, vocab) for i, n in enumerate(lengths)]
    runner = ModelRunner(tiny_loaded, num_blocks=48, **kernels)
    tables, next_block = [], 0
    for seq in seqs:
        blocks = (len(seq) + 1 + BLOCK_SIZE - 1) // BLOCK_SIZE
        tables.append(list(range(next_block, next_block + blocks))[::-1])
        next_block += blocks
    runner.forward(
        [BatchEntry(seq[:-1], 0, table) for seq, table in zip(seqs, tables, strict=True)]
    )
    got = runner.forward(
        [BatchEntry(seq[-1:], len(seq) - 1, table) for seq, table in zip(seqs, tables, strict=True)]
    )
    expected = torch.stack([hf_logits(tiny_hf, seq)[-1] for seq in seqs])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(20))
def test_padding_groups_are_optimal_contiguous_runs(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    counts = sorted(torch.randint(1, 60, (7,), generator=generator).tolist(), reverse=True)

    def cost(groups: list[tuple[int, int]]) -> int:
        return sum(GROUP_COST_IN_BLOCKS + counts[start] * (end - start) for start, end in groups)

    groups = padding_groups(counts)
    assert groups[0][0] == 0 and groups[-1][1] == len(counts)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(groups))
    best = min(
        cost(list(zip((0, *cuts), (*cuts, len(counts)), strict=True)))
        for r in range(len(counts))
        for cuts in itertools.combinations(range(1, len(counts)), r)
    )
    assert cost(groups) == best
