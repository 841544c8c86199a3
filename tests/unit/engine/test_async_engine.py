"""AsyncEngine on the tiny random Llama: streams, aborts, early close, hold / import."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

import pytest
import torch

from services.worker.engine.async_engine import AsyncEngine
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.loader import LoadedModel, load_model
from services.worker.engine.request import (
    EngineRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
)

NUM_BLOCKS = 32
LONG = SamplingParams(max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir))


@pytest.fixture
async def engine(tiny_loaded: LoadedModel) -> AsyncIterator[AsyncEngine]:
    config = EngineConfig(num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=64)
    async_engine = AsyncEngine(Engine(tiny_loaded, config))
    await async_engine.start()
    yield async_engine
    await async_engine.shutdown()


def prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (length,), generator=generator).tolist()


async def all_blocks_free(engine: AsyncEngine) -> None:
    """Wait for the engine thread to publish a stats snapshot with no block used (it takes a
    step or two; the bound is generous for a loaded machine)."""
    for _ in range(1000):
        stats = engine.stats()
        if stats.kv_blocks_free == NUM_BLOCKS and stats.running + stats.waiting == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks still used: {engine.stats()}")


async def collect(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [out async for out in stream]


async def test_generate_streams_until_finished(engine: AsyncEngine) -> None:
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = await collect(engine.generate(EngineRequest("a", prompt(1, 20), sampling)))
    assert sum(len(o.new_token_ids) for o in outs) == 12
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert [o.finish_reason for o in outs[:-1]] == [None] * 11
    await all_blocks_free(engine)


async def test_concurrent_streams_match_sequential_runs(engine: AsyncEngine) -> None:
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)
    requests = [EngineRequest(f"c{i}", prompt(i, 10 + 7 * i), sampling) for i in range(4)]
    alone = [await collect(engine.generate(req)) for req in requests]
    together = await asyncio.gather(*(collect(engine.generate(req)) for req in requests))
    for a, b in zip(alone, together, strict=True):
        assert [o.new_token_ids for o in a] == [o.new_token_ids for o in b]
    await all_blocks_free(engine)


async def test_abort_ends_the_stream_and_frees_blocks(engine: AsyncEngine) -> None:
    stream = engine.generate(EngineRequest("x", prompt(2, 40), LONG))
    outs = []
    async for out in stream:
        outs.append(out)
        if len(outs) == 3:
            await engine.abort("x")
    assert outs[-1].finish_reason is FinishReason.ABORT
    assert outs[-1].num_output_tokens < 200
    await all_blocks_free(engine)


async def test_closing_the_iterator_early_aborts(engine: AsyncEngine) -> None:
    async with aclosing(engine.generate(EngineRequest("y", prompt(3, 40), LONG))) as stream:
        async for out in stream:
            assert out.finish_reason is None
            break
    await all_blocks_free(engine)
    # The id is free again once the stream is closed.
    sampling = SamplingParams(max_tokens=2)
    assert (await collect(engine.generate(EngineRequest("y", [5, 6], sampling))))[-1].finish_reason


async def test_cancelled_consumer_task_aborts(engine: AsyncEngine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(EngineRequest("z", prompt(4, 30), LONG)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await all_blocks_free(engine)


async def test_invalid_request_raises_from_the_stream(engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        await collect(engine.generate(EngineRequest("bad", [], LONG)))
    await all_blocks_free(engine)


async def test_prefill_hold_export_and_import_round_trip(engine: AsyncEngine) -> None:
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    tokens = prompt(5, 37)  # 2 full blocks + 5
    reference = await collect(engine.generate(EngineRequest("ref", tokens, sampling)))
    expected = [t for o in reference for t in o.new_token_ids]

    first, handle = await engine.prefill_and_hold(EngineRequest("p", tokens, sampling))
    assert handle is not None and first.new_token_ids == expected[:1]
    assert len(await engine.export_blocks(handle.handle_id, [0, 2])) == 2
    # Importing into the same engine: the full blocks are cached, only the partial one moves.
    plan = await engine.start_import(
        EngineRequest("d", tokens, sampling), handle.block_hashes, handle.num_tokens
    )
    assert plan.missing_indices == [2]
    (blob,) = await engine.export_blocks(handle.handle_id, [2])
    await engine.write_imported_block(plan, 2, blob)
    assert await engine.release(handle.handle_id) == 3
    rest = await collect(engine.commit_import(plan, first.new_token_ids[0]))
    assert first.new_token_ids + [t for o in rest for t in o.new_token_ids] == expected
    assert engine.stats().num_held_handles == 0
    await all_blocks_free(engine)


async def test_cancel_import_and_unknown_handle(engine: AsyncEngine) -> None:
    tokens = prompt(6, 20)
    _, handle = await engine.prefill_and_hold(EngineRequest("p2", tokens, LONG))
    assert handle is not None
    plan = await engine.start_import(
        EngineRequest("d2", tokens, LONG), handle.block_hashes, handle.num_tokens
    )
    await engine.cancel_import(plan)
    await engine.release(handle.handle_id)
    with pytest.raises(KeyError):
        await engine.release(handle.handle_id)
    await all_blocks_free(engine)


async def test_shutdown_aborts_open_streams(tiny_loaded: LoadedModel) -> None:
    async_engine = AsyncEngine(Engine(tiny_loaded, EngineConfig(num_kv_blocks=NUM_BLOCKS)))
    await async_engine.start()
    stream = async_engine.generate(EngineRequest("s", prompt(7, 10), LONG))
    first = await anext(stream)
    assert first.finish_reason is None
    await async_engine.shutdown()
    rest = await collect(stream)
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert async_engine.engine.pool.num_free_blocks == NUM_BLOCKS
