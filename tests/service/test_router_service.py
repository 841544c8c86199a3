"""The router over in-process workers on the tiny model: placement, auto, fallback, retry."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import jsonschema
import pytest
import yaml

from kvmesh.config import load_config
from kvmesh.errors import DeadlineExceeded
from kvmesh.rpc_status import error_from_status
from kvmesh.v1 import common_pb2, gateway_pb2, router_pb2, router_pb2_grpc, worker_pb2
from services.router.__main__ import Router, build_router
from services.router.config import RouterConfig
from tests.service.worker_mesh import (
    GREEDY,
    SEEDED,
    InProcessWorker,
    ManyStream,
    all_idle,
    offline,
    request,
    route,
    route_many,
    start_worker,
    wait_until,
)

SHORT = list(range(30, 50))  # 20 tokens: "easy" under the auto rule below
LONG = list(range(100, 180))  # 80 tokens: "hard"
SMALL_OUTPUT = common_pb2.SamplingParams(max_tokens=8, ignore_eos=True)


@dataclass
class Mesh:
    """Tier "tiny": prefill p0, p1 and decode d0; "tiny-co": colocated c0 (same weights);
    "tiny-int8": colocated q0 (int8), the fallback of "tiny" and the cheap tier of "auto"."""

    workers: dict[str, InProcessWorker]
    router: Router
    channel: grpc.aio.Channel
    stub: router_pb2_grpc.RouterStub

    def address(self, name: str) -> str:
        return self.workers[name].address

    async def close(self) -> None:
        await self.channel.close()
        await self.router.stop()
        await asyncio.gather(*(w.stop() for w in self.workers.values()))


def pools_document(workers: dict[str, InProcessWorker]) -> dict[str, object]:
    return {
        "tiers": [
            {
                "name": "tiny",
                "usd_per_gpu_hour": 3.6,
                "tokens_per_second": 1000,
                "fallback": "tiny-int8",
                "prefill": [workers["p0"].address, workers["p1"].address],
                "decode": [workers["d0"].address],
            },
            {"name": "tiny-co", "colocated": [workers["c0"].address]},
            {
                "name": "tiny-int8",
                "quantization": "int8",
                "usd_per_gpu_hour": 1.8,
                "tokens_per_second": 1000,
                "colocated": [workers["q0"].address],
            },
        ],
        "auto": {
            "cheap": "tiny-int8",
            "full": "tiny",
            "max_prompt_tokens": 32,
            "max_output_tokens": 16,
        },
    }


async def start_mesh(model: Path, tmp_path: Path, *router_args: str) -> Mesh:
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode", "c0": "colocated", "q0": "colocated"}
    started = await asyncio.gather(
        *(
            start_worker(model, role, *(["--quantization", "int8"] if name == "q0" else []))
            for name, role in roles.items()
        )
    )
    workers = dict(zip(roles, started, strict=True))
    pools = tmp_path / "pools.yaml"
    pools.write_text(yaml.safe_dump(pools_document(workers)))
    args = ["--config", str(pools), "--port", "0", "--metrics-port", "-1"]
    router = build_router(load_config(RouterConfig, [*args, *router_args]))
    await router.start()
    channel = grpc.aio.insecure_channel(router.server.address)
    return Mesh(workers, router, channel, router_pb2_grpc.RouterStub(channel))


@pytest.fixture
async def mesh(tiny_llama_dir: Path, tmp_path: Path) -> AsyncIterator[Mesh]:
    started = await start_mesh(tiny_llama_dir, tmp_path, "--refresh-interval-s", "0.1")
    yield started
    await started.close()


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_split_and_colocated_through_the_router_equal_offline(
    mesh: Mesh, tiny_llama_dir: Path, sampling: common_pb2.SamplingParams
) -> None:
    (expected,) = offline(tiny_llama_dir, [LONG], sampling)
    split = await route(mesh.stub, request("split", LONG, sampling, model="tiny"))
    alone = await route(mesh.stub, request("alone", LONG, sampling, model="tiny-co"))
    assert split.token_ids == expected
    assert alone.token_ids == expected
    assert split.text == alone.text

    placement = split.started.placement
    assert split.started.model == "tiny" and split.started.request_id == "split"
    assert placement.prefill_worker in (mesh.address("p0"), mesh.address("p1"))
    assert placement.decode_worker == mesh.address("d0")
    assert (placement.fallback, placement.attempts) == (False, 1)
    assert "split" in placement.reason and "decode" in placement.reason
    assert alone.started.placement.prefill_worker == mesh.address("c0")
    assert alone.started.placement.decode_worker == mesh.address("c0")
    assert "colocated" in alone.started.placement.reason

    finished = split.finished
    assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert finished.usage.prompt_tokens == len(LONG)
    assert finished.usage.completion_tokens == len(expected)
    assert finished.timings.ttft_ms > 0 and finished.timings.e2e_ms >= finished.timings.ttft_ms
    assert finished.timings.kv_transfer_ms > 0
    assert await all_idle([w.stub for w in mesh.workers.values()])


async def test_prefill_goes_where_the_prefix_is_cached(mesh: Mesh) -> None:
    # Warm p1 (not the first choice on a tie) with the prompt, then release the lease.
    warm = await mesh.workers["p1"].stub.Prefill(
        worker_pb2.PrefillRequest(request=request("warm", LONG))
    )
    await mesh.workers["p1"].stub.ReleaseKv(
        worker_pb2.ReleaseKvRequest(lease_id=warm.lease.lease_id)
    )

    async def router_sees_cache() -> bool:
        status = await mesh.stub.Status(router_pb2.RouterStatusRequest())
        return any(
            w.address == mesh.address("p1") and w.stats.num_cached_blocks >= 5
            for pool in status.pools
            for w in pool.workers
        )

    assert await wait_until(router_sees_cache)
    result = await route(mesh.stub, request("hit", [*LONG, 1, 2, 3], SMALL_OUTPUT, model="tiny"))
    placement = result.started.placement
    assert placement.prefill_worker == mesh.address("p1")
    assert placement.expected_prefix_hit_tokens == 80
    assert "80 cached prefix tokens" in placement.reason
    assert result.finished.usage.cached_prompt_tokens == 80


async def test_requests_that_arrive_together_are_spread_over_the_tier(mesh: Mesh) -> None:
    # Placed before any of them starts on a worker: each must see the ones placed before it.
    # Long answers keep all four in flight until the last is placed, on a slow machine too.
    prompts = [[30 + i, *range(60, 100)] for i in range(4)]
    sampling = common_pb2.SamplingParams(max_tokens=400, ignore_eos=True)
    results = await asyncio.gather(
        *(
            route(mesh.stub, request(f"burst{i}", prompt, sampling, model="tiny"))
            for i, prompt in enumerate(prompts)
        )
    )
    placed = Counter(result.started.placement.prefill_worker for result in results)
    assert placed == {mesh.address("p0"): 2, mesh.address("p1"): 2}
    assert await all_idle([w.stub for w in mesh.workers.values()])
    assert all(w.inflight == 0 for w in mesh.router.registry.workers())


async def test_auto_routes_by_difficulty_and_falls_back_when_the_full_tier_is_down(
    mesh: Mesh,
) -> None:
    easy = await route(mesh.stub, request("easy", SHORT, SMALL_OUTPUT, model="auto"))
    hard = await route(mesh.stub, request("hard", LONG, SMALL_OUTPUT, model="auto"))
    labelled = await route(
        mesh.stub,
        request("label", SHORT, SMALL_OUTPUT, model="auto", labels={"difficulty": "hard"}),
    )
    assert easy.started.model == "tiny-int8" and "cheap tier" in easy.started.placement.reason
    assert hard.started.model == "tiny" and "full tier" in hard.started.placement.reason
    assert labelled.started.model == "tiny"
    assert not (easy.started.placement.fallback or hard.started.placement.fallback)

    await mesh.workers["d0"].stop()  # the full tier has no decode worker left (and no colocated)

    async def full_tier_down() -> bool:
        models = await mesh.stub.ListModels(gateway_pb2.ListModelsRequest())
        return not next(m for m in models.models if m.id == "tiny").available

    assert await wait_until(full_tier_down)
    for model in ("auto", "tiny"):
        result = await route(mesh.stub, request(f"fb-{model}", LONG, SMALL_OUTPUT, model=model))
        assert result.started.model == "tiny-int8"
        assert result.started.placement.fallback
        assert (
            "fallback: tiny has no healthy worker -> tiny-int8" in result.started.placement.reason
        )
        assert result.finished.usage.completion_tokens == 8
    del mesh.workers["d0"]


async def test_a_failure_before_the_first_token_is_retried_on_another_worker(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    # The router refreshes rarely, so it still believes p0 (first choice on a tie) is alive.
    mesh = await start_mesh(tiny_llama_dir, tmp_path, "--refresh-interval-s", "60")
    try:
        (expected,) = offline(tiny_llama_dir, [LONG], GREEDY)
        await mesh.workers.pop("p0").stop()
        result = await route(mesh.stub, request("retry", LONG, model="tiny"))
        placement = result.started.placement
        assert result.token_ids == expected
        assert placement.attempts == 2
        assert placement.prefill_worker == mesh.address("p1")
        assert "retry after UNAVAILABLE" in placement.reason
        assert await all_idle([w.stub for w in mesh.workers.values()])

        # A tier whose only worker is gone and that has no fallback: nowhere to retry.
        await mesh.workers.pop("c0").stop()
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await route(mesh.stub, request("alone", LONG, model="tiny-co"))
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no worker left to retry on" in (raised.value.details() or "")
    finally:
        await mesh.close()


async def _cancelled_request(
    stub: router_pb2_grpc.RouterStub, index: int, rng: random.Random
) -> None:
    model = rng.choice(["tiny", "tiny-co", "tiny-int8"])
    prompt = LONG if rng.random() < 0.5 else SHORT
    sampling = common_pb2.SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True)
    call = stub.Generate(timeout=30)
    await call.write(
        router_pb2.RouteMessage(request=request(f"c{index}", prompt, sampling, model=model))
    )
    stop_after = rng.randint(0, 6)  # events to read first (0: cancel at once)
    events = []
    if stop_after:
        async for event in call:
            events.append(event)
            if len(events) >= stop_after:
                break
    if rng.random() < 0.3:
        call.cancel()  # the caller goes away
        return
    try:
        await call.write(router_pb2.RouteMessage(cancel=common_pb2.Cancel(reason="test")))
    except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
        return  # the request finished before the cancel went out
    events.extend([event async for event in call])
    last = events[-1].finished
    assert last.finish_reason in (common_pb2.FINISH_REASON_ABORT, common_pb2.FINISH_REASON_LENGTH)
    assert last.usage.completion_tokens == sum(
        len(e.chunk.token_ids) for e in events if e.WhichOneof("event") == "chunk"
    )


async def test_200_cancelled_requests_leave_every_worker_idle(mesh: Mesh) -> None:
    rng = random.Random(7)
    limit = asyncio.Semaphore(16)

    async def one(index: int) -> None:
        async with limit:
            await _cancelled_request(mesh.stub, index, rng)

    await asyncio.gather(*(one(i) for i in range(200)))
    assert await all_idle([w.stub for w in mesh.workers.values()], within=10.0)
    assert all(w.inflight == 0 for w in mesh.router.registry.workers())


async def test_colocated_requests_share_one_stream_to_their_worker_while_any_runs(
    mesh: Mesh, tiny_llama_dir: Path
) -> None:
    prompts = [list(range(start, start + 24)) for start in range(40, 340, 50)]
    expected = offline(tiny_llama_dir, prompts, GREEDY)
    results = await asyncio.gather(
        *(
            route(mesh.stub, request(f"together-{i}", prompt, model="tiny-co"))
            for i, prompt in enumerate(prompts)
        )
    )
    assert [result.token_ids for result in results] == expected
    assert all(r.started.placement.prefill_worker == mesh.address("c0") for r in results)
    # The stream, idle since its last generation ended, ends when the worker's channel is
    # retired: the channel has no call left to wait for.
    mesh.router.peers.retire(mesh.address("c0"))

    async def closed() -> bool:
        return mesh.router.peers.closing == 0

    assert await wait_until(closed, 2.0)


@pytest.mark.parametrize("via", ["Generate", "GenerateMany"])
@pytest.mark.parametrize("model", ["tiny", "tiny-co"], ids=["split", "colocated"])
async def test_deadline_ends_the_stream_with_partial_output(
    mesh: Mesh, model: str, via: str
) -> None:
    send = route if via == "Generate" else route_many
    long_output = common_pb2.SamplingParams(max_tokens=400, ignore_eos=True)
    # Half the time the router takes for the whole answer here and now (the faster of two,
    # the second warm and its prompt cached like the one cut): a fast machine finishes 400
    # tokens of the tiny model inside any fixed deadline short enough for a slow one.
    wholes = []
    for name in ("whole", "whole-again"):
        whole = await send(mesh.stub, request(name, LONG, long_output, model=model))
        assert whole.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
        wholes.append(whole.finished.timings.e2e_ms / 1000)
    deadline_s = min(wholes) / 2
    started = time.monotonic()
    try:
        late = request("late", LONG, long_output, model=model)
        result = await send(mesh.stub, late, deadline_s)
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    except DeadlineExceeded:
        assert via == "GenerateMany"  # its generation's error, the stream's status is OK
    else:
        assert result.finished.finish_reason == common_pb2.FINISH_REASON_DEADLINE
        assert 0 < result.finished.usage.completion_tokens < 400
    assert time.monotonic() - started < deadline_s + 1.2
    assert await all_idle([w.stub for w in mesh.workers.values()])


async def test_generate_many_runs_split_and_colocated_requests_as_generate_does(
    mesh: Mesh, tiny_llama_dir: Path
) -> None:
    prompts = [LONG, SHORT, list(range(200, 230))]
    models = ["tiny", "tiny-co", "tiny-co"]
    expected = offline(tiny_llama_dir, prompts, GREEDY)
    stream = ManyStream(mesh.stub.GenerateMany)
    for i, (prompt, model) in enumerate(zip(prompts, models, strict=True)):
        stream.send(i + 1, request=request(f"many-{i}", prompt, model=model), timeout_ms=30_000)
    await stream.read_until({1, 2, 3})
    assert [stream.token_ids(i) for i in (1, 2, 3)] == expected
    placements = [stream.events[i][0].started.placement for i in (1, 2, 3)]
    assert placements[0].decode_worker == mesh.address("d0")
    assert [p.prefill_worker for p in placements[1:]] == [mesh.address("c0")] * 2
    assert all(stream.finish_reason(i) == common_pb2.FINISH_REASON_LENGTH for i in (1, 2, 3))
    # Events that were ready together went out in one message.
    assert stream.messages < sum(len(events) for events in stream.events.values())
    stream.half_close()
    assert await stream.call.read() is grpc.aio.EOF
    assert await stream.call.code() == grpc.StatusCode.OK
    assert await all_idle([w.stub for w in mesh.workers.values()])


async def test_generate_many_cancels_one_request_and_runs_the_others_on(mesh: Mesh) -> None:
    long_output = common_pb2.SamplingParams(max_tokens=400, ignore_eos=True)
    stream = ManyStream(mesh.stub.GenerateMany)
    stream.send(1, request=request("cancelled", LONG, long_output, model="tiny"))
    stream.send(2, request=request("kept", SHORT, model="tiny-co"))
    await stream.read_until({2})
    assert 1 not in stream.ended
    stream.send(1, cancel=common_pb2.Cancel(reason="the test is done with it"))
    await stream.read_until({1})
    assert stream.finish_reason(1) == common_pb2.FINISH_REASON_ABORT
    assert len(stream.token_ids(1)) < long_output.max_tokens
    assert stream.finish_reason(2) == common_pb2.FINISH_REASON_LENGTH
    assert await all_idle([w.stub for w in mesh.workers.values()])
    stream.half_close()
    assert await stream.call.code() == grpc.StatusCode.OK


async def test_generate_many_fails_a_bad_message_alone(mesh: Mesh) -> None:
    many_stops = common_pb2.SamplingParams(max_tokens=4, stop=["x"] * 30_000)
    stream = ManyStream(mesh.stub.GenerateMany)
    stream.send(1)  # neither a request nor a cancel
    stream.send(2, request=request("unknown", LONG, model="nope"))
    stream.send(3, request=request("stops", LONG, many_stops, model="tiny"))
    stream.send(4, request=request("good", SHORT, model="tiny-co"))
    await stream.read_until({1, 2, 3, 4})
    failures = {i: error_from_status(status) for i, status in stream.errors.items()}
    assert {i: e.status for i, e in failures.items()} == dict.fromkeys(
        (1, 2, 3), "INVALID_ARGUMENT"
    )
    assert "nope" in str(failures[2])
    assert failures[3].message.startswith("sampling.stop")
    assert stream.finish_reason(4) == common_pb2.FINISH_REASON_LENGTH
    assert await all_idle([w.stub for w in mesh.workers.values()])
    stream.half_close()


async def test_a_broken_generate_many_stream_stops_its_requests_on_the_workers(mesh: Mesh) -> None:
    long_output = common_pb2.SamplingParams(max_tokens=400, ignore_eos=True)
    stream = ManyStream(mesh.stub.GenerateMany)
    stream.send(1, request=request("cut-split", LONG, long_output, model="tiny"))
    stream.send(2, request=request("cut-colocated", SHORT, long_output, model="tiny-co"))
    await stream.call.read()  # the router has placed them
    stream.call.cancel()
    assert await all_idle([w.stub for w in mesh.workers.values()])
    assert all(w.inflight == 0 for w in mesh.router.registry.workers())


async def test_status_models_and_pool_changes(mesh: Mesh, tiny_llama_dir: Path) -> None:
    status = await mesh.stub.Status(router_pb2.RouterStatusRequest())
    pools = [(p.tier, p.role, len(p.workers)) for p in status.pools]
    assert pools == [
        ("tiny", worker_pb2.WORKER_ROLE_PREFILL, 2),
        ("tiny", worker_pb2.WORKER_ROLE_DECODE, 1),
        ("tiny-co", worker_pb2.WORKER_ROLE_COLOCATED, 1),
        ("tiny-int8", worker_pb2.WORKER_ROLE_COLOCATED, 1),
    ]
    assert all(w.healthy and w.stats.kv_blocks_total == 64 for p in status.pools for w in p.workers)
    assert all(p.recommended_replicas >= 1 for p in status.pools)

    models = {m.id: m for m in (await mesh.stub.ListModels(gateway_pb2.ListModelsRequest())).models}
    assert list(models) == ["tiny", "tiny-co", "tiny-int8"]
    assert models["tiny"].fallback == "tiny-int8" and models["tiny"].available
    # One worker's throughput: the pools file's 1,000 tok/s until its decode worker measured
    # its own; then the most that worker sustained, and the price follows.
    assert models["tiny"].tokens_per_second == 1000
    assert models["tiny"].usd_per_1k_tokens == pytest.approx(0.001)
    await route(mesh.stub, request("measured", LONG, SMALL_OUTPUT))
    decode = mesh.workers["d0"].stub
    peak = (await decode.Stats(worker_pb2.StatsRequest())).peak_tokens_per_second
    assert peak > 0

    async def measured() -> bool:
        listed = await mesh.stub.ListModels(gateway_pb2.ListModelsRequest())
        return listed.models[0].tokens_per_second == pytest.approx(peak)

    assert await wait_until(measured)
    (tiny, *_) = (await mesh.stub.ListModels(gateway_pb2.ListModelsRequest())).models
    assert tiny.usd_per_1k_tokens == pytest.approx(3.6 / 3600 / peak * 1000)
    assert models["tiny-int8"].quantization == "int8"
    assert models["tiny"].fingerprint == models["tiny-co"].fingerprint
    assert models["tiny"].fingerprint != models["tiny-int8"].fingerprint
    assert models["tiny"].context_length == 512

    extra = await start_worker(tiny_llama_dir, "decode")
    try:
        added = await mesh.stub.AddWorker(
            router_pb2.AddWorkerRequest(
                tier="tiny", role=worker_pb2.WORKER_ROLE_DECODE, address=extra.address
            )
        )
        decode_pool = next(p for p in added.status.pools if p.role == worker_pb2.WORKER_ROLE_DECODE)
        assert [(w.address, w.healthy) for w in decode_pool.workers][-1] == (extra.address, True)
        removed = await mesh.stub.RemoveWorker(
            router_pb2.RemoveWorkerRequest(address=extra.address)
        )
        assert extra.address not in {w.address for p in removed.status.pools for w in p.workers}
    finally:
        await extra.stop()
    for call, code in (
        (
            mesh.stub.RemoveWorker(router_pb2.RemoveWorkerRequest(address=extra.address)),
            grpc.StatusCode.NOT_FOUND,
        ),
        (
            mesh.stub.AddWorker(
                router_pb2.AddWorkerRequest(
                    tier="nope", role=worker_pb2.WORKER_ROLE_DECODE, address="127.0.0.1:1"
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        assert raised.value.code() == code


async def test_bad_requests_are_rejected(mesh: Mesh) -> None:
    for model, prompt in (
        ("nope", LONG),
        ("", LONG),
        ("tiny", []),
        ("tiny-co", list(range(1, 400)) * 2),  # longer than the context
    ):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await route(mesh.stub, request("bad", prompt, model=model))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (model, len(prompt))
    # The mesh's bounds hold at the router too, for a caller that skipped the gateway.
    many_stops = common_pb2.SamplingParams(max_tokens=4, stop=["x"] * 30_000)
    many_labels = {f"k{i}": "v" for i in range(100_000)}
    for bad, field in (
        (request("stops", LONG, many_stops, model="tiny"), "sampling.stop"),
        (request("labels", LONG, model="tiny", labels=many_labels), "labels"),
        (request("x" * 1000, LONG, model="tiny"), "request_id"),
        (
            request("regex", LONG, common_pb2.SamplingParams(regex="a" * 70_000), model="tiny"),
            "sampling.regex",
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await route(mesh.stub, bad)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = raised.value.details() or ""
        assert details.startswith(field), details
        assert not any(w.address in details for w in mesh.workers.values())  # the router's own
    assert await all_idle([w.stub for w in mesh.workers.values()])


CONSTRAINED_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "rooms": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}},
        "open": {"type": "boolean"},
    },
    "required": ["city", "rooms", "open"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [None, 11], ids=["greedy", "seeded"])
async def test_a_constrained_answer_is_the_same_split_colocated_and_offline(
    mesh: Mesh, tiny_llama_dir: Path, seed: int | None
) -> None:
    """The constraint travels router -> prefill -> decode unchanged: the prefill worker samples
    the first token under it, the decode worker rebuilds the matcher and continues."""
    sampling = common_pb2.SamplingParams(max_tokens=80, json_schema=json.dumps(CONSTRAINED_SCHEMA))
    if seed is not None:
        sampling.temperature, sampling.top_p, sampling.seed = 0.9, 0.95, seed
    (expected,) = offline(tiny_llama_dir, [LONG], sampling)
    split = await route(mesh.stub, request("split", LONG, sampling, model="tiny"))
    alone = await route(mesh.stub, request("alone", LONG, sampling, model="tiny-co"))
    assert split.token_ids == alone.token_ids == expected
    assert split.text == alone.text
    assert split.finished.finish_reason == common_pb2.FINISH_REASON_STOP
    jsonschema.validate(json.loads(split.text, strict=False), CONSTRAINED_SCHEMA)
    assert await all_idle([w.stub for w in mesh.workers.values()])


async def test_a_constraint_that_does_not_compile_is_invalid_argument(mesh: Mesh) -> None:
    """Refused by the worker's compile (the router's bounds pass it), named, not retried."""
    bad = common_pb2.SamplingParams(max_tokens=8, json_schema='{"type": "strnig"}')
    for model in ("tiny", "tiny-co"):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await route(mesh.stub, request(f"bad-{model}", LONG, bad, model=model))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.json_schema" in (raised.value.details() or "")
    assert await all_idle([w.stub for w in mesh.workers.values()])
