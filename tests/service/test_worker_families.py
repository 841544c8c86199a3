"""The worker service on every family beyond Llama (tiny random Qwen2, Qwen3, Mistral
checkpoints): colocated and split across a prefill and a decode worker, the KV hand-off
carrying the family's layout (Qwen3's head_dim 24, Mistral's one KV head)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvmesh.v1 import common_pb2
from services.worker.engine.loader import load_model
from tests.service.worker_mesh import (
    GREEDY,
    SEEDED,
    InProcessWorker,
    all_idle,
    colocated,
    disaggregated,
    offline,
    prefill_request,
    request,
    start_worker,
)
from tests.tiny_checkpoints import FAMILIES, write_tiny_checkpoint

# Longer than Mistral's 24-token window, over several blocks.
PROMPTS = [list(range(20, 90)), list(range(300, 331))]


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "mistral"])
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = FAMILIES[request.param]
    return write_tiny_checkpoint(family, tmp_path_factory.mktemp(f"tiny_{family.name}"))


@pytest.fixture
async def workers(family_dir: Path) -> AsyncIterator[list[InProcessWorker]]:
    started = [
        await start_worker(family_dir, "prefill"),
        await start_worker(family_dir, "decode"),
        await start_worker(family_dir, "colocated"),
    ]
    yield started
    await asyncio.gather(*(worker.stop() for worker in started))


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_split_equals_colocated_equals_offline(
    workers: list[InProcessWorker], family_dir: Path, sampling: common_pb2.SamplingParams
) -> None:
    prefill, decode, both = workers
    expected = offline(family_dir, PROMPTS, sampling)
    for index, prompt in enumerate(PROMPTS):
        alone = await colocated(both.stub, request(f"c{index}", prompt, sampling))
        split = await disaggregated(prefill, decode, request(f"s{index}", prompt, sampling))
        assert alone.token_ids == split.token_ids == expected[index]
        assert split.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert await all_idle([worker.stub for worker in workers])


async def test_the_lease_carries_the_family_layout(
    workers: list[InProcessWorker], family_dir: Path
) -> None:
    prefill, decode, _ = workers
    prefilled = await prefill.stub.Prefill(prefill_request(request("l", PROMPTS[0]), decode))
    config = load_model(str(family_dir)).config
    layout = prefilled.lease.layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
    )
