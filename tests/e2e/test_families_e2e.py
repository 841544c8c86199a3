"""A second family through the whole mesh (issue 18.2): `kvmesh up` serving a tiny random Qwen2
checkpoint folder (Q/K/V bias, GQA, tied embeddings), colocated and split across a prefill and a
decode worker (the KV handed off between them); requests through the gateway return
transformers' greedy tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

import kvmesh
from tests.e2e.test_stack import RunningStack, start_kvmesh_up
from tests.tiny_checkpoints import FAMILIES, write_tiny_checkpoint
from tests.unit.engine.greedy import transformers_greedy

PROMPT_LENGTHS = [5, 40, 70]
"""Shorter than one 16-token KV block, and several blocks with a part-filled last one."""
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(FAMILIES["qwen2"], tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def prompts(qwen2_dir: Path) -> list[list[int]]:
    """Ids of the tokenizer's vocabulary (the gateway refuses others), which is smaller than the
    model's odd-sized embedding."""
    generator = torch.Generator().manual_seed(3)
    vocab = Tokenizer.from_file(str(qwen2_dir / "tokenizer.json")).get_vocab_size()
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def stack(
    request: pytest.FixtureRequest, qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    running = start_kvmesh_up(
        qwen2_dir, tmp_path_factory.mktemp(f"qwen2-{request.param}"), "--mode", request.param
    )
    yield running
    running.kill()


def test_qwen2_through_the_gateway_gives_transformers_greedy_tokens(
    stack: RunningStack, qwen2_dir: Path, prompts: list[list[int]]
) -> None:
    expected = transformers_greedy(qwen2_dir, prompts, MAX_TOKENS)
    with kvmesh.SyncClient(stack.gateway) as client:
        results = [
            client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, cache_policy="bypass")
            for prompt in prompts
        ]
    for prompt, result, tokens in zip(prompts, results, expected, strict=True):
        assert result.token_ids == tokens, f"{len(prompt)}-token prompt"
