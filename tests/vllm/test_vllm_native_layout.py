"""vLLM against kvmesh's native engine: the same greedy tokens, and KV hand-off both ways once
the layouts agree (vLLM exporting in the native byte order, native engine on 32-token blocks).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from kvmesh.config import load_config
from services.worker.__main__ import build_worker
from services.worker.backends.vllm_engine import VllmEngine
from services.worker.config import WorkerConfig
from services.worker.engine.async_engine import AsyncEngine
from services.worker.engine.config import EngineConfig
from tests.service.worker_mesh import (
    GREEDY,
    InProcessWorker,
    all_idle,
    colocated,
    disaggregated,
    offline,
    prompt_whose_first_two_tokens_have_text,
    request,
    sampled,
    worker_args,
)
from tests.vllm.conftest import start_vllm_worker, vllm_engine

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [list(range(20, 60)), list(range(100, 170))]
# Prompts neither worker has seen before the hand-off test, so every block moves.
FRESH_PROMPTS = [list(range(200, 240)), list(range(250, 320))]


@dataclass
class Pair:
    vllm: InProcessWorker
    native: InProcessWorker


async def start_native_worker(model: Path, block_size: int) -> InProcessWorker:
    config = load_config(WorkerConfig, worker_args(model, "colocated"))
    engine = AsyncEngine.from_config(config.engine_config.replace(block_size=block_size))
    worker = build_worker(config, engine)
    await worker.start()
    return InProcessWorker(worker, grpc.aio.insecure_channel(worker.server.address))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair(tiny_llama32_dir: Path) -> AsyncIterator[Pair]:
    workers = Pair(
        await start_vllm_worker(tiny_llama32_dir, "colocated", wire_format="native"),
        await start_native_worker(tiny_llama32_dir, block_size=32),
    )
    yield workers
    await workers.vllm.stop()
    await workers.native.stop()


@pytest.mark.parametrize(
    ("configured", "wire_format", "runs"),
    [(16, "vllm", 128), (16, "native", 32), (64, "vllm", 64), (32, "native", 32)],
)
async def test_vllm_takes_its_own_block_size_in_place_of_one_its_kernels_refuse(
    tiny_llama32_dir: Path, configured: int, wire_format: str, runs: int
) -> None:
    """The native default of 16 becomes vLLM's own 128, or 32 in the native byte order (what
    native workers can match); a multiple of 32 is kept."""
    config = EngineConfig(model=str(tiny_llama32_dir), block_size=configured)
    engine = VllmEngine.from_config(config, kv_wire_format=wire_format, eager=True)
    try:
        assert engine.layout.block_size == engine.config.block_size == runs
    finally:
        await engine.shutdown()


async def test_colocated_vllm_matches_native_greedy(pair: Pair, tiny_llama32_dir: Path) -> None:
    expected = offline(tiny_llama32_dir, PROMPTS, GREEDY)
    for index, prompt in enumerate(PROMPTS):
        result = await colocated(pair.vllm.stub, request(f"c{index}", prompt))
        assert result.token_ids == expected[index]
        assert result.finished.usage.prompt_tokens == len(prompt)


async def test_hand_off_both_ways_when_layouts_agree(pair: Pair, tiny_llama32_dir: Path) -> None:
    stats = await pair.vllm.stats(), await pair.native.stats()
    assert stats[0].layout == stats[1].layout
    assert stats[0].model_fingerprint == stats[1].model_fingerprint
    expected = offline(tiny_llama32_dir, FRESH_PROMPTS, GREEDY)
    engine = vllm_engine(pair.vllm)
    for index, prompt in enumerate(FRESH_PROMPTS):
        loaded_before = engine.kv_loaded_tokens
        into_vllm = await disaggregated(pair.native, pair.vllm, request(f"n{index}", prompt))
        assert engine.kv_loaded_tokens - loaded_before == len(prompt)
        out_of_vllm = await disaggregated(pair.vllm, pair.native, request(f"v{index}", prompt))
        assert into_vllm.token_ids == expected[index]
        assert out_of_vllm.token_ids == expected[index]
    assert await all_idle([pair.vllm.stub, pair.native.stub])
    assert engine.num_entries == 0


async def test_stop_strings_and_stop_tokens_leave_the_ids_and_text_the_native_engine_leaves(
    pair: Pair,
) -> None:
    """TokenChunk's contract on the vLLM backend too: a stop string or stop token is in neither
    the ids nor the text, colocated and handed off both ways, exactly as on the native engine
    (a stop string that begins at the first token: the prefill side holds that token back)."""
    prompt, texts = await prompt_whose_first_two_tokens_have_text(pair.native.stub)
    free = await colocated(pair.native.stub, request("free", prompt))
    cases = {
        "never-completes": sampled(stop=[texts[1] + "\x00never"]),
        "first-two": sampled(stop=[texts[2]]),
        "stop-token": sampled(stop_token_ids=[free.token_ids[2]]),
    }
    for name, sampling in cases.items():
        native = await colocated(pair.native.stub, request(f"{name}-n", prompt, sampling))
        expected = (native.token_ids, native.text, native.finished.finish_reason)
        results = [
            await colocated(pair.vllm.stub, request(f"{name}-v", prompt, sampling)),
            await disaggregated(pair.native, pair.vllm, request(f"{name}-nv", prompt, sampling)),
            await disaggregated(pair.vllm, pair.native, request(f"{name}-vn", prompt, sampling)),
        ]
        for result in results:
            assert (result.token_ids, result.text, result.finished.finish_reason) == expected, name
    assert await all_idle([pair.vllm.stub, pair.native.stub])
