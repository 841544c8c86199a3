"""The worker service on the tiny model: colocated, split, the KV hand-off and its errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker.engine.async_engine import AsyncEngine
from tests.service.worker_mesh import (
    GREEDY,
    KV_BLOCKS,
    SEEDED,
    InProcessWorker,
    StreamResult,
    all_idle,
    collect,
    colocated,
    decode_start,
    disaggregated,
    offline,
    prefill_request,
    prompt_whose_first_two_tokens_have_text,
    request,
    sampled,
    start_worker,
    wait_until,
)
from tests.thread_gate import Gate

PROMPTS = [list(range(20, 60)), list(range(300, 321))]
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K and V x layers x block x kv heads x head dim x fp32


@dataclass
class Trio:
    prefill: InProcessWorker
    decode: InProcessWorker
    both: InProcessWorker

    @property
    def stubs(self) -> list[worker_pb2_grpc.WorkerStub]:
        return [self.prefill.stub, self.decode.stub, self.both.stub]


@pytest.fixture
async def trio(tiny_llama_dir: Path) -> AsyncIterator[Trio]:
    workers = Trio(
        await start_worker(tiny_llama_dir, "prefill"),
        await start_worker(tiny_llama_dir, "decode"),
        await start_worker(tiny_llama_dir, "colocated"),
    )
    yield workers
    await asyncio.gather(workers.prefill.stop(), workers.decode.stop(), workers.both.stop())


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_split_equals_colocated_equals_offline(
    trio: Trio, tiny_llama_dir: Path, sampling: common_pb2.SamplingParams
) -> None:
    expected = offline(tiny_llama_dir, PROMPTS, sampling)
    for index, prompt in enumerate(PROMPTS):
        alone = await colocated(trio.both.stub, request(f"c{index}", prompt, sampling))
        split = await disaggregated(
            trio.prefill, trio.decode, request(f"s{index}", prompt, sampling)
        )
        assert alone.token_ids == expected[index]
        assert split.token_ids == expected[index]
        assert split.text == alone.text
        for result in (alone, split):
            assert result.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert result.finished.usage.prompt_tokens == len(prompt)
            assert result.finished.usage.completion_tokens == len(expected[index])
            assert all(chunk.token_ids for chunk in result.chunks)
        assert split.finished.timings.kv_transfer_ms > 0
    assert await all_idle(trio.stubs)


async def _both_ways(
    trio: Trio, name: str, prompt: list[int], sampling: common_pb2.SamplingParams
) -> tuple[StreamResult, StreamResult]:
    """The request on the colocated worker, and handed off from prefill to decode."""
    alone = await colocated(trio.both.stub, request(f"{name}-c", prompt, sampling))
    split = await disaggregated(trio.prefill, trio.decode, request(f"{name}-s", prompt, sampling))
    return alone, split


async def test_token_ids_and_text_leave_out_stop_strings_and_stop_tokens_alike_split_or_not(
    trio: Trio,
) -> None:
    """The contract of TokenChunk: a stop token and a stop string are in neither the ids nor
    the text, on one worker or handed off, and a first token held back by the prefill worker
    (its text may begin a stop string) reaches the caller from the decode worker."""
    prompt, texts = await prompt_whose_first_two_tokens_have_text(trio.both.stub)
    free = await colocated(trio.both.stub, request("free", prompt, GREEDY))
    ids = free.token_ids

    # A stop string that begins with the first token's text and never completes: the prefill
    # worker holds the token back; the caller gets every token and all the text in the end.
    never = sampled(stop=[texts[1] + "\x00never"])
    held = request("held-p", prompt, never)
    prefilled = await trio.prefill.stub.Prefill(prefill_request(held, trio.decode))
    assert (list(prefilled.first_token.token_ids), prefilled.first_token.text) == ([], "")
    assert list(prefilled.sampled.token_ids) == ids[:1]
    await trio.prefill.stub.ReleaseKv(
        worker_pb2.ReleaseKvRequest(lease_id=prefilled.lease.lease_id)
    )
    for result in await _both_ways(trio, "held", prompt, never):
        assert (result.token_ids, result.text) == (ids, free.text)
        assert result.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    # A stop string that starts at the first token and completes at the second: nothing at all.
    for result in await _both_ways(trio, "gone", prompt, sampled(stop=[texts[2]])):
        assert (result.token_ids, result.text) == ([], "")
        assert result.finished.finish_reason == common_pb2.FINISH_REASON_STOP
        assert result.finished.usage.completion_tokens == 2  # both were generated
    # A stop token: the tokens before it, not itself.
    before = ids.index(ids[2])
    for result in await _both_ways(trio, "token", prompt, sampled(stop_token_ids=[ids[2]])):
        assert (result.token_ids, result.text) == (ids[:before], texts[before])
        assert result.finished.finish_reason == common_pb2.FINISH_REASON_STOP
        assert result.finished.usage.completion_tokens == before + 1
    assert await all_idle(trio.stubs)


def _transfer(direction: str) -> tuple[float, float]:
    labels = {"direction": direction}
    blocks = REGISTRY.get_sample_value("kvmesh:kv_transfer_blocks_total", labels) or 0.0
    moved = REGISTRY.get_sample_value("kvmesh:kv_transfer_bytes_total", labels) or 0.0
    return blocks, moved


async def test_decode_pulls_only_the_blocks_it_lacks(trio: Trio) -> None:
    shared = list(range(100, 148))  # three full blocks
    first = request("a", [*shared, *range(10, 20)])  # 58 tokens: 3 full blocks + 1 partial
    second = request("b", [*shared, *range(200, 221)])  # 69 tokens: 4 full + 1 partial
    before = _transfer("received"), _transfer("sent")
    await disaggregated(trio.prefill, trio.decode, first)
    after_first = _transfer("received"), _transfer("sent")
    assert after_first[0][0] - before[0][0] == 4  # nothing cached yet: every block moves
    await disaggregated(trio.prefill, trio.decode, second)
    received, sent = _transfer("received"), _transfer("sent")
    # The decode worker holds the shared prefix: only blocks 3 and 4 of the second lease move.
    assert received[0] - after_first[0][0] == 2
    assert received[1] - after_first[0][1] == 2 * BLOCK_BYTES
    assert sent[0] - after_first[1][0] == 2
    assert sent[1] - after_first[1][1] == 2 * BLOCK_BYTES
    assert await all_idle(trio.stubs)


async def _decode_error(trio: Trio, message: worker_pb2.DecodeMessage) -> grpc.aio.AioRpcError:
    call = trio.decode.stub.Decode(timeout=10)
    await call.write(message)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        _ = [event async for event in call]
    return raised.value


async def test_fingerprint_or_layout_mismatch_is_failed_precondition(trio: Trio) -> None:
    req = request("fp", PROMPTS[0])
    prefilled = await trio.prefill.stub.Prefill(prefill_request(req, trio.decode))
    lease = prefilled.lease

    wrong_fingerprint = decode_start(req, prefilled)
    wrong_fingerprint.start.lease.model_fingerprint = "0" * 16
    error = await _decode_error(trio, wrong_fingerprint)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "fingerprint" in (error.details() or "")

    for pull in (
        worker_pb2.PullKvRequest(
            lease_id=lease.lease_id, model_fingerprint="0" * 16, layout=lease.layout
        ),
        worker_pb2.PullKvRequest(
            lease_id=lease.lease_id,
            model_fingerprint=lease.model_fingerprint,
            layout=common_pb2.KvLayout(
                dtype="float32", block_size=8, num_layers=2, num_kv_heads=2, head_dim=16
            ),
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            _ = [chunk async for chunk in trio.prefill.stub.PullKv(pull)]
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    released = await trio.prefill.stub.ReleaseKv(
        worker_pb2.ReleaseKvRequest(lease_id=lease.lease_id)
    )
    assert released.blocks_released == len(lease.block_hashes)
    assert await all_idle(trio.stubs)


async def test_expired_lease_is_not_found_everywhere(trio: Trio) -> None:
    req = request("late", PROMPTS[0])
    prefilled = await trio.prefill.stub.Prefill(prefill_request(req, trio.decode, 200))
    lease = prefilled.lease
    await asyncio.sleep(0.4)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        pull = worker_pb2.PullKvRequest(
            lease_id=lease.lease_id, model_fingerprint=lease.model_fingerprint, layout=lease.layout
        )
        _ = [chunk async for chunk in trio.prefill.stub.PullKv(pull)]
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await trio.prefill.stub.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=lease.lease_id))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    error = await _decode_error(trio, decode_start(req, prefilled))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert await all_idle(trio.stubs)


async def test_a_lease_never_pulled_is_freed_by_its_ttl(trio: Trio) -> None:
    start = await trio.prefill.stats()
    prefilled = await trio.prefill.stub.Prefill(
        prefill_request(request("idle", PROMPTS[0]), trio.decode, 300)
    )
    pinned = start.kv_blocks_free - len(prefilled.lease.block_hashes)

    async def held() -> bool:
        stats = await trio.prefill.stats()  # a snapshot from the engine's latest step
        return stats.active_leases == 1 and stats.kv_blocks_free == pinned

    assert await wait_until(held, within=0.25, interval=0.01)
    assert await all_idle([trio.prefill.stub], within=3.0)


async def _first_chunk(call: grpc.aio.StreamStreamCall) -> None:
    async for event in call:
        if event.WhichOneof("event") == "chunk":
            return
    raise AssertionError("the stream ended before its first chunk")


LONG = common_pb2.SamplingParams(max_tokens=400, ignore_eos=True)


async def test_cancel_and_disconnect_free_the_blocks(trio: Trio) -> None:
    prompt = PROMPTS[0]
    # Colocated, Cancel message: the stream ends with Finished(ABORT).
    call = trio.both.stub.Generate(timeout=30)
    await call.write(worker_pb2.WorkerGenerateMessage(request=request("g1", prompt, LONG)))
    await _first_chunk(call)
    await call.write(worker_pb2.WorkerGenerateMessage(cancel=common_pb2.Cancel(reason="test")))
    rest = [event async for event in call]
    assert rest[-1].finished.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert rest[-1].finished.usage.completion_tokens < 400
    # Colocated, the caller goes away.
    call = trio.both.stub.Generate(timeout=30)
    await call.write(worker_pb2.WorkerGenerateMessage(request=request("g2", prompt, LONG)))
    await _first_chunk(call)
    call.cancel()
    # Split, Cancel message, then split with the caller gone.
    for rid, disconnect in (("d1", False), ("d2", True)):
        req = request(rid, prompt, LONG)
        prefilled = await trio.prefill.stub.Prefill(prefill_request(req, trio.decode))
        call = trio.decode.stub.Decode(timeout=30)
        await call.write(decode_start(req, prefilled))
        await _first_chunk(call)
        if disconnect:
            call.cancel()
        else:
            await call.write(worker_pb2.DecodeMessage(cancel=common_pb2.Cancel(reason="test")))
            rest = [event async for event in call]
            assert rest[-1].finished.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert await all_idle(trio.stubs)


async def test_stats_and_roles(trio: Trio) -> None:
    await colocated(trio.both.stub, request("s1", PROMPTS[0]))
    await colocated(trio.both.stub, request("s2", PROMPTS[0]))  # its two full blocks hit
    stats = await trio.both.stub.Stats(worker_pb2.StatsRequest(include_block_hashes=True))
    assert stats.prefix_cache_hit_rate == pytest.approx(32 / 80)
    assert stats.role == worker_pb2.WORKER_ROLE_COLOCATED
    assert stats.kv_blocks_total == KV_BLOCKS and stats.block_size == 16
    assert stats.num_cached_blocks == len(stats.cached_block_hashes) > 0
    assert stats.layout.num_layers == 2 and stats.context_length == 512
    assert len(stats.model_fingerprint) > 0
    assert (await trio.both.stats()).cached_block_hashes == []  # only when asked for

    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await trio.decode.stub.Prefill(worker_pb2.PrefillRequest(request=request("r", PROMPTS[0])))
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Streams: the refusal comes after the first message, which the caller's write delivers.
    generate = trio.prefill.stub.Generate(timeout=5)
    await generate.write(worker_pb2.WorkerGenerateMessage(request=request("r", PROMPTS[0])))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        _ = [event async for event in generate]
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    req = request("d", PROMPTS[0])
    prefilled = await trio.prefill.stub.Prefill(prefill_request(req, trio.decode))
    decode_on_prefill = trio.prefill.stub.Decode(timeout=5)
    await decode_on_prefill.write(decode_start(req, prefilled))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        _ = [event async for event in decode_on_prefill]
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await trio.prefill.stub.ReleaseKv(
        worker_pb2.ReleaseKvRequest(lease_id=prefilled.lease.lease_id)
    )
    cancel_first = trio.both.stub.Generate(timeout=5)
    await cancel_first.write(worker_pb2.WorkerGenerateMessage(cancel=common_pb2.Cancel()))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        _ = [event async for event in cancel_first]
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    too_long = request("long", list(range(1, 400)) * 2)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await colocated(trio.both.stub, too_long)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await all_idle(trio.stubs)


async def test_hand_off_completes_while_the_prefill_engine_is_mid_step(
    trio: Trio, tiny_llama_dir: Path
) -> None:
    """PullKv reads held blocks off the engine thread: a long step on the prefill worker (a
    long chunked prefill in real life, a gated forward here) does not hold up the hand-off."""
    (expected,) = offline(tiny_llama_dir, [PROMPTS[0]], GREEDY)
    req = request("handed", PROMPTS[0])
    prefilled = await trio.prefill.stub.Prefill(prefill_request(req, trio.decode))
    engine = trio.prefill.worker.engine
    assert isinstance(engine, AsyncEngine)
    gate = Gate()
    runner = engine.engine.runner
    runner.forward = gate.wrap(runner.forward)  # type: ignore[method-assign]
    occupant = asyncio.ensure_future(
        trio.prefill.stub.Prefill(prefill_request(request("busy", PROMPTS[1]), trio.decode))
    )
    try:
        await gate.wait_entered()
        call = trio.decode.stub.Decode(timeout=30)
        await call.write(decode_start(req, prefilled))
        # Before, the export waited for the gated step: the whole decode timed out.
        split = await asyncio.wait_for(collect(call), 10.0)
        assert not occupant.done()
    finally:
        gate.opened.set()
        busy = await occupant
        del runner.forward
    assert split.token_ids == expected
    assert split.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    await trio.prefill.stub.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=busy.lease.lease_id))
    assert await all_idle(trio.stubs)


async def test_a_duplicate_request_id_is_refused_and_leaves_the_first_intact(trio: Trio) -> None:
    """A second request under an id in use gets ALREADY_EXISTS; the first runs to the end
    (colocated, and split: a duplicate Prefill and a duplicate Decode)."""
    prompt = PROMPTS[0]
    first = trio.both.stub.Generate(timeout=30)
    await first.write(worker_pb2.WorkerGenerateMessage(request=request("dup", prompt, LONG)))
    await _first_chunk(first)
    duplicate = trio.both.stub.Generate(timeout=30)
    await duplicate.write(worker_pb2.WorkerGenerateMessage(request=request("dup", prompt)))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(duplicate)
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    rest = await collect(first)
    assert rest.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert rest.finished.usage.completion_tokens == LONG.max_tokens

    req = request("dup-split", prompt, LONG)
    prefilled = await trio.prefill.stub.Prefill(prefill_request(req, trio.decode))
    decoding = trio.decode.stub.Decode(timeout=30)
    await decoding.write(decode_start(req, prefilled))
    await _first_chunk(decoding)
    again = await trio.prefill.stub.Prefill(prefill_request(req, trio.decode))
    duplicate_decode = trio.decode.stub.Decode(timeout=30)
    await duplicate_decode.write(decode_start(req, again))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(duplicate_decode)
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    rest = await collect(decoding)
    assert rest.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert rest.finished.usage.completion_tokens == LONG.max_tokens
    await trio.prefill.stub.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=again.lease.lease_id))
    assert await all_idle(trio.stubs)
