"""AsyncEngine on the tiny random Llama: streams, aborts, early close, hold / import, KV copies
off the engine thread."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from services.worker.engine.api import (
    EngineRequest,
    FinishReason,
    ImportPlan,
    KvHandle,
    Priority,
    RequestOutput,
    SamplingParams,
)
from services.worker.engine.async_engine import AsyncEngine
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.loader import LoadedModel, load_model
from tests.thread_gate import Gate

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


# A fresh process: its threads before AsyncEngine.from_config, and after once the load's have
# ended (they end just after it returns; a team left behind never does: 10 s is plenty).
THREADS_AROUND_LOAD = """
import os, sys, time
from services.worker.engine.async_engine import AsyncEngine
from services.worker.engine.config import EngineConfig
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
AsyncEngine.from_config(EngineConfig(model=sys.argv[1], num_kv_blocks=4096))
for _ in range(100):
    if threads() == before:
        break
    time.sleep(0.1)
print(before, threads())
"""


def test_from_config_leaves_no_openmp_team_on_the_caller(tiny_llama_dir: Path) -> None:
    """The load's parallel ops (the KV cache's zero fill among them) run on a thread that ends
    with its OpenMP team: none stays on the caller beside the engine thread's, which would make
    every team's threads sleep at barriers (async_engine._load_apart)."""
    done = subprocess.run(
        [sys.executable, "-c", THREADS_AROUND_LOAD, str(tiny_llama_dir)],
        capture_output=True,
        text=True,
        check=True,
    )
    before, after = done.stdout.split()
    assert after == before


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


async def test_a_hold_cancelled_right_after_its_handle_arrives_releases_it(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel lands after the handle was delivered but before the caller resumed: the
    caller never sees the handle, so prefill_and_hold itself must unpin the blocks."""
    task: asyncio.Task[object] | None = None
    deliver = engine._deliver

    def deliver_then_cancel(items: list[tuple[RequestOutput, object]]) -> None:
        deliver(items)  # type: ignore[arg-type]
        assert task is not None
        task.cancel()

    monkeypatch.setattr(engine, "_deliver", deliver_then_cancel)
    task = asyncio.create_task(engine.prefill_and_hold(EngineRequest("h", prompt(8, 40), LONG)))
    with pytest.raises(asyncio.CancelledError):
        await task
    await engine.shutdown()  # the engine is ours to inspect once its thread has stopped
    assert engine.engine.kv.num_held == 0
    assert engine.engine.pool.num_free_blocks == NUM_BLOCKS


async def test_an_interactive_arrival_interrupts_a_batch_only_step(engine: AsyncEngine) -> None:
    batch = SamplingParams(max_tokens=12, ignore_eos=True)
    tokens = prompt(11, 30)
    reference = await collect(
        engine.generate(EngineRequest("ref", tokens, batch, priority=Priority.BATCH))
    )
    gate = Gate()
    runner = engine.engine.runner
    runner.forward = gate.wrap(runner.forward)  # type: ignore[method-assign]
    batch_run = asyncio.create_task(
        collect(engine.generate(EngineRequest("b", tokens, batch, priority=Priority.BATCH)))
    )
    await gate.wait_entered()  # the engine thread is inside a step of batch work only
    interactive = SamplingParams(max_tokens=3, ignore_eos=True)
    interactive_run = asyncio.create_task(
        collect(engine.generate(EngineRequest("i", prompt(12, 20), interactive)))
    )
    await asyncio.sleep(0.1)  # the interactive request is submitted
    del runner.forward  # later steps run ungated
    gate.opened.set()
    outs = await interactive_run
    assert sum(len(o.new_token_ids) for o in outs) == 3
    assert [t for o in await batch_run for t in o.new_token_ids] == [
        t for o in reference for t in o.new_token_ids
    ]
    await engine.shutdown()
    assert engine.engine.num_interrupted_steps == 1
    assert engine.engine.pool.num_free_blocks == NUM_BLOCKS


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


# ---- KV copies off the engine thread --------------------------------------------------------


@contextlib.asynccontextmanager
async def stalled_step(engine: AsyncEngine, seed: int) -> AsyncIterator[None]:
    """An engine thread stuck inside a model forward (of a request started here) until the
    block ends: any work queued for the engine thread waits for the block's end."""
    gate = Gate()
    runner = engine.engine.runner
    runner.forward = gate.wrap(runner.forward)  # type: ignore[method-assign]
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    occupant = asyncio.create_task(
        collect(engine.generate(EngineRequest("busy", prompt(seed, 30), sampling)))
    )
    try:
        await gate.wait_entered()
        yield
    finally:
        gate.opened.set()
        await occupant
        del runner.forward


async def test_export_does_not_wait_for_the_engine_step(engine: AsyncEngine) -> None:
    tokens = prompt(8, 37)  # 2 full blocks + 5
    _, handle = await engine.prefill_and_hold(EngineRequest("p", tokens, LONG))
    assert handle is not None
    before = await engine.export_blocks(handle.handle_id, [0, 1, 2])
    async with stalled_step(engine, seed=9):
        # The old export, an engine command, would wait for the stalled step: it timed out.
        during = await asyncio.wait_for(engine.export_blocks(handle.handle_id, [2, 0]), 5.0)
    assert during == [before[2], before[0]]
    assert await engine.release(handle.handle_id) == 3
    await all_blocks_free(engine)


async def test_imported_block_write_does_not_wait_for_the_engine_step(
    tiny_loaded: LoadedModel, engine: AsyncEngine
) -> None:
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens = prompt(10, 37)
    source = AsyncEngine(Engine(tiny_loaded, EngineConfig(num_kv_blocks=NUM_BLOCKS)))
    await source.start()
    try:
        reference = await collect(source.generate(EngineRequest("r", tokens, sampling)))
        first, handle = await source.prefill_and_hold(EngineRequest("p", tokens, sampling))
        assert handle is not None
        blobs = await source.export_blocks(handle.handle_id, [0, 1, 2])
        await source.release(handle.handle_id)
    finally:
        await source.shutdown()
    plan = await engine.start_import(
        EngineRequest("d", tokens, sampling), handle.block_hashes, handle.num_tokens
    )
    assert plan.missing_indices == [0, 1, 2]
    async with stalled_step(engine, seed=11):
        writes = (engine.write_imported_block(plan, i, blob) for i, blob in enumerate(blobs))
        await asyncio.wait_for(asyncio.gather(*writes), 5.0)
    rest = await collect(engine.commit_import(plan, first.new_token_ids[0]))
    expected = [t for o in reference for t in o.new_token_ids]
    assert first.new_token_ids + [t for o in rest for t in o.new_token_ids] == expected
    await all_blocks_free(engine)


class GatedExport(NamedTuple):
    """An export of a held handle's three blocks, stuck inside its block read."""

    handle: KvHandle
    gate: Gate
    export: asyncio.Task[list[bytes]]
    pinned_while_read: list[bool]
    """Per read: whether every block read was still pinned (ref count > 0) while read."""


async def start_gated_export(engine: AsyncEngine, seed: int) -> GatedExport:
    _, handle = await engine.prefill_and_hold(EngineRequest("p", prompt(seed, 37), LONG))
    assert handle is not None
    pool = engine.engine.pool
    read = engine.engine.read_blocks
    pinned_while_read: list[bool] = []

    def checked_read(block_ids: list[int]) -> list[bytes]:
        blobs = read(block_ids)
        pinned_while_read.append(all(pool.ref_count(b) > 0 for b in block_ids))
        return blobs

    gate = Gate()
    engine.engine.read_blocks = gate.wrap(checked_read)  # type: ignore[method-assign]
    export = asyncio.create_task(engine.export_blocks(handle.handle_id, [0, 1, 2]))
    await gate.wait_entered()
    return GatedExport(handle, gate, export, pinned_while_read)


async def test_release_waits_for_an_export_in_flight(engine: AsyncEngine) -> None:
    handle, gate, export, pinned_while_read = await start_gated_export(engine, seed=12)
    release = asyncio.create_task(engine.release(handle.handle_id))
    await asyncio.sleep(0.3)  # ample time for the engine thread to run a release command
    assert not release.done()
    assert engine.stats().num_held_handles == 1
    assert engine.stats().kv_blocks_free == NUM_BLOCKS - 3
    with pytest.raises(KeyError):  # the handle is on its way out: no new exports
        await engine.export_blocks(handle.handle_id, [0])
    gate.opened.set()
    assert [len(b) for b in await export] == [engine.layout.block_bytes] * 3
    assert await release == 3
    assert pinned_while_read == [True]
    with pytest.raises(KeyError):
        await engine.export_blocks(handle.handle_id, [0])
    with pytest.raises(KeyError):
        await engine.release(handle.handle_id)
    await all_blocks_free(engine)


async def test_cancelled_export_and_release_still_free_after_the_read(
    engine: AsyncEngine,
) -> None:
    handle, gate, export, pinned_while_read = await start_gated_export(engine, seed=13)
    export.cancel()  # the read goes on: cancelling the caller cannot stop a running thread
    release = asyncio.create_task(engine.release(handle.handle_id))
    await asyncio.sleep(0.1)
    release.cancel()  # the release, once asked for, happens anyway
    for task in (export, release):
        with pytest.raises(asyncio.CancelledError):
            await task
    assert engine.stats().num_held_handles == 1
    gate.opened.set()
    await all_blocks_free(engine)
    assert pinned_while_read == [True]
    assert engine.stats().num_held_handles == 0


async def test_cancel_and_commit_wait_for_writes_in_flight(engine: AsyncEngine) -> None:
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    tokens = prompt(14, 37)
    first, handle = await engine.prefill_and_hold(EngineRequest("p", tokens, sampling))
    assert handle is not None
    (blob,) = await engine.export_blocks(handle.handle_id, [2])
    fill = engine.engine.fill_imported_block

    async def import_with_a_stuck_write(
        request_id: str,
    ) -> tuple[Gate, ImportPlan, asyncio.Task[None]]:
        gate = Gate()
        engine.engine.fill_imported_block = gate.wrap(fill)  # type: ignore[method-assign]
        plan = await engine.start_import(
            EngineRequest(request_id, tokens, sampling), handle.block_hashes, handle.num_tokens
        )
        write = asyncio.create_task(engine.write_imported_block(plan, 2, blob))
        await gate.wait_entered()
        return gate, plan, write

    # Cancel: waits for the write, then frees the plan's blocks; later writes are refused.
    gate, plan, write = await import_with_a_stuck_write("c")
    cancel = asyncio.create_task(engine.cancel_import(plan))
    await asyncio.sleep(0.3)
    assert not cancel.done()
    with pytest.raises(KeyError):
        await engine.write_imported_block(plan, 2, blob)
    gate.opened.set()
    await write
    await cancel

    # Commit: its stream starts only once the write in flight has ended.
    gate, plan, write = await import_with_a_stuck_write("d")
    stream = engine.commit_import(plan, first.new_token_ids[0])
    output = asyncio.create_task(anext(stream))
    await asyncio.sleep(0.3)
    assert not output.done()
    assert engine.stats().running == 0
    gate.opened.set()
    await write
    rest = [await output, *await collect(stream)]
    assert sum(len(o.new_token_ids) for o in rest) == 3
    assert await engine.release(handle.handle_id) == 3
    await all_blocks_free(engine)
