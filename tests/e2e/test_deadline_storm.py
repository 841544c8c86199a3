"""A storm of short deadlines, Cancels and disconnects through the whole mesh (issue 14.7).

Gateway, router and workers are subprocesses on the tiny random Llama, once split (a prefill
worker whose KV sends are slowed, so a hand-off lasts long enough to be cut, and a decode
worker) and once colocated. Requests with deadlines drawn from zero to past one whole
request's time end in every phase: waiting at the gateway, waiting in the engine, mid-prefill,
mid-hand-off, mid-decode. After the storm every KV block is free again, no lease is left, the
gateway's running and waiting gauges are 0, and no service logged an ERROR line or a
traceback: an ordinary deadline, cancel or disconnect is not an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

from kvmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.e2e.test_admission import gateway_args, gauge, until
from tests.procs import ServiceProcess, alarming_lines, start_service
from tests.service.worker_mesh import worker_args

pytestmark = pytest.mark.e2e

TIER = "tiny"
KV_SEND_MB_S = "0.5"  # a 400-token prompt's KV (about 210 kB) takes about 0.4 s to send
KV_BLOCKS = "256"
"""Each worker's pool: room for a dozen requests at once (fewer would refuse hand-offs)."""
MAX_TOKENS = 160
STORM_REQUESTS = 300
STORM_WAVE = 30
STORM_EXTRA_WAVES = 4
"""Waves added, at most, while no deadline has yet cut a request mid-stream."""
IN_FLIGHT = "12"
"""The gateway's limit: the rest of a wave waits (or is shed) at the gateway."""
PRIORITIES = ("interactive", "batch")
LAST_WRITE_MARGIN_S = 0.05
"""A Cancel due this close to the call's deadline is not written (the deadline ends it)."""
ACCEPTABLE_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # the deadline passed before the first token
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # shed: the wait would outlast the deadline
    grpc.StatusCode.CANCELLED,  # the client cut its own call
}
CLIENT_WRITE_RACE = "Internal error from Core"
"""The details grpc aio gives the INTERNAL status it sets on its own side when a write fails
because the call has just ended (grpc/grpc#36066), whatever status the gateway sent."""


@dataclass
class StormStack:
    workers: list[ServiceProcess]
    router: ServiceProcess
    gateway: ServiceProcess

    def all(self) -> list[ServiceProcess]:
        return [*self.workers, self.router, self.gateway]


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def storm_stack(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StormStack]:
    state = tmp_path_factory.mktemp(f"storm-{request.param}")
    started: list[ServiceProcess] = []
    blocks = ["--num-kv-blocks", KV_BLOCKS]
    try:
        if request.param == "disaggregated":
            prefill = ["--kv-send-max-mb-s", KV_SEND_MB_S, "--lease-ttl-s", "1"]
            plans = {
                "prefill": worker_args(tiny_llama_dir, "prefill", *blocks, *prefill),
                "decode": worker_args(tiny_llama_dir, "decode", *blocks),
            }
        else:
            plans = {"colocated": worker_args(tiny_llama_dir, "colocated", *blocks)}
        pools: dict[str, object] = {"name": TIER, "base_model": TIER}
        for role, args in plans.items():
            worker = start_service("services.worker", args)
            started.append(worker)
            pools[role] = [worker.address]
        config = state / "pools.yaml"
        config.write_text(yaml.safe_dump({"tiers": [pools]}))
        router = start_service(
            "services.router",
            ["--config", str(config), "--port", "0", "--metrics-port", "-1",
             "--refresh-interval-s", "0.2"],
        )  # fmt: skip
        started.append(router)
        gateway = start_service(
            "services.admission",
            gateway_args(router.address, tiny_llama_dir, "--max-in-flight", IN_FLIGHT,
                         "--batch-max-in-flight", IN_FLIGHT, "--min-in-flight", IN_FLIGHT),
        )  # fmt: skip
        started.append(gateway)
        yield StormStack(started[: len(plans)], router, gateway)
    finally:
        for process in reversed(started):
            process.terminate()


def long_prompt(rng: random.Random) -> str:
    """About 400 tokens (the tiny tokenizer spends about one a character), none shared with
    another prompt's start beyond the first block: every prefill is a real one."""
    return f"{rng.getrandbits(64):016x} " + " ".join(str(rng.randrange(100)) for _ in range(130))


def generate_request(rng: random.Random, max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=common_pb2.Prompt(text=long_prompt(rng)),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        priority=common_pb2.PRIORITY_BATCH
        if rng.random() < 0.3
        else common_pb2.PRIORITY_INTERACTIVE,
        cache_policy=common_pb2.CACHE_POLICY_BYPASS,
    )


async def one_call(
    stub: gateway_pb2_grpc.GatewayStub,
    request: gateway_pb2.GenerateRequest,
    deadline_s: float,
    ending: str,
    after_s: float,
) -> tuple[grpc.StatusCode, str, list[common_pb2.GenerateEvent]]:
    """One request under `deadline_s`, ended by its deadline alone, by a Cancel written
    `after_s` in, or by cutting the call then (a client that goes away); its status, the
    status's details and the events it received."""
    outbox: asyncio.Queue[gateway_pb2.GenerateClientMessage | None] = asyncio.Queue()
    outbox.put_nowait(gateway_pb2.GenerateClientMessage(request=request))

    async def messages() -> AsyncIterator[gateway_pb2.GenerateClientMessage]:
        while (message := await outbox.get()) is not None:
            yield message

    call = stub.Generate(messages(), timeout=deadline_s)
    events: list[common_pb2.GenerateEvent] = []

    async def read() -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for event in call:
                events.append(event)
                if event.HasField("finished"):
                    # Half-closed after the answer's end, as the SDK does: the gateway keeps
                    # the call open until then (or a Cancel), at most 1 s, so that a Cancel
                    # racing the end still finds it open.
                    outbox.put_nowait(None)

    reader = asyncio.ensure_future(read())
    started = time.monotonic()
    if ending != "deadline":
        await asyncio.wait({reader}, timeout=after_s)
        if reader.done():
            pass  # the call already ended (a refusal, an answer): nothing left to end
        elif ending == "cancel":
            # A write that grpc's core fails because the call just ended makes grpc aio set
            # the call's status to INTERNAL on this side (_write: set_internal_error), whatever
            # the gateway answered. So the Cancel is written only once the request has started
            # (before, the gateway may be refusing it: an error status, with no stream kept
            # open for a racing write) and not in the call's last moments (its own deadline).
            if events and time.monotonic() - started < deadline_s - LAST_WRITE_MARGIN_S:
                outbox.put_nowait(gateway_pb2.GenerateClientMessage(cancel=common_pb2.Cancel()))
        else:
            call.cancel()
    await reader
    outbox.put_nowait(None)
    return await call.code(), await call.details(), events


async def one_whole_request_s(stub: gateway_pb2_grpc.GatewayStub) -> float:
    """How long one long request takes here and now, alone (however loaded the machine)."""
    started = time.monotonic()
    code, details, events = await one_call(
        stub, generate_request(random.Random(0), 64), 60, "deadline", 0
    )
    assert code == grpc.StatusCode.OK and events[-1].HasField("finished"), (code, details, events)
    return time.monotonic() - started


async def worker_stats(worker: ServiceProcess) -> worker_pb2.WorkerStats:
    async with grpc.aio.insecure_channel(worker.address) as channel:
        return await worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest())


def outcome(code: grpc.StatusCode, details: str, events: list[common_pb2.GenerateEvent]) -> str:
    """What ended a call: its status, or its finish reason and whether any token came first."""
    if code == grpc.StatusCode.INTERNAL and details == CLIENT_WRITE_RACE and not events:
        # The request message's own write lost the race with a call the gateway had already
        # ended (a refusal, or its deadline): grpc aio then reports INTERNAL on this side over
        # the gateway's status. The client writes nothing else before Started.
        return "request write raced the call's end"
    assert code in ACCEPTABLE_CODES, (code, details, events)
    if code != grpc.StatusCode.OK:
        return code.name
    kinds = [event.WhichOneof("event") for event in events]
    assert kinds[0] == "started" and kinds[-1] == "finished", kinds
    tokens = sum(len(event.chunk.token_ids) for event in events)
    assert events[-1].finished.usage.completion_tokens == tokens, events[-1]
    reason = common_pb2.FinishReason.Name(events[-1].finished.finish_reason)
    return f"{reason} {'after tokens' if tokens else 'before any token'}"


async def test_a_storm_of_deadlines_cancels_and_disconnects_leaves_nothing_behind(
    storm_stack: StormStack,
) -> None:
    rng = random.Random(147)
    before = [await worker_stats(w) for w in storm_stack.workers]
    assert all(s.kv_blocks_free == s.kv_blocks_total for s in before), before
    outcomes: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(storm_stack.gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        whole_s = await one_whole_request_s(stub)

        async def wave(start: int, shortest_s: float) -> None:
            calls = []
            for index in range(start, start + STORM_WAVE):
                ending = ("deadline", "deadline", "cancel", "disconnect")[index % 4]
                deadline_s = rng.uniform(shortest_s, 3 * whole_s)
                after_s = rng.uniform(0.0, deadline_s)
                request = generate_request(rng, rng.randrange(8, MAX_TOKENS))
                calls.append(one_call(stub, request, deadline_s, ending, after_s))
            outcomes.update(outcome(*ended) for ended in await asyncio.gather(*calls))

        # From a deadline that passes while the request waits at the gateway to one past a
        # whole request's time behind a wave of others.
        for start in range(0, STORM_REQUESTS, STORM_WAVE):
            await wave(start, 0.02)
        # Where the machine's speed left no deadline inside a stream, a few more waves whose
        # deadlines all come after a whole request's time (the storm must cover that case).
        for extra in range(STORM_EXTRA_WAVES):
            if outcomes["FINISH_REASON_DEADLINE after tokens"]:
                break
            await wave(STORM_REQUESTS + extra * STORM_WAVE, whole_s)
    # The storm did cut requests before their first token and while they streamed.
    assert outcomes["FINISH_REASON_DEADLINE after tokens"], outcomes
    assert outcomes["DEADLINE_EXCEEDED"] + outcomes["FINISH_REASON_DEADLINE before any token"]

    async def settled() -> bool:
        stats = [await worker_stats(w) for w in storm_stack.workers]
        left = [
            (s.running, s.waiting, s.kv_blocks_total - s.kv_blocks_free, s.active_leases)
            for s in stats
        ]
        gauges = [
            await asyncio.to_thread(gauge, storm_stack.gateway, name, priority)
            for name in ("running", "waiting")
            for priority in PRIORITIES
        ]
        settled.__doc__ = (
            "every worker's running, waiting, used KV blocks and leases, and the gateway's "
            f"running and waiting gauges all 0 after the storm (seen {left}, {gauges})"
        )
        return all(v == 0 for v in [*(n for row in left for n in row), *gauges])

    await until(settled, within_s=30.0)
    after = [await worker_stats(w) for w in storm_stack.workers]
    assert [s.kv_blocks_free for s in after] == [s.kv_blocks_free for s in before]
    alarms = {p.name: found for p in storm_stack.all() if (found := alarming_lines(p.log()))}
    assert not alarms, f"ERROR lines or tracebacks after the storm ({outcomes}): {alarms}"
