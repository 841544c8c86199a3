"""Admission that knows what the workers can do, through real gRPC servers: an in-process
gateway in front of an in-process router and a colocated tiny worker.

The router measures the worker's prefill and decode rates on the requests it runs and reports
them in ListModels; a gateway whose one slot is taken sheds a request whose expected wait plus
service time does not fit in its deadline at once (RESOURCE_EXHAUSTED with a retry-after),
where the old fixed admission (--no-adaptive-admission) queues it and lets it run into its
deadline.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

import kvmesh
from kvmesh.config import load_config
from kvmesh.contracts.tokenizer import Tokenizer
from kvmesh.errors import ResourceExhausted
from kvmesh.service_rates import ServiceRates
from kvmesh.v1 import common_pb2, router_pb2_grpc
from services.router.__main__ import Router, build_router
from services.router.config import RouterConfig
from tests.service.admission.conftest import StartGateway
from tests.service.worker_mesh import (
    InProcessWorker,
    all_idle,
    request,
    route,
    start_worker,
    wait_until,
)

PROMPT = "Numbers: 0 1 2"
LONG_ANSWER = 400


@dataclass
class Mesh:
    worker: InProcessWorker
    router: Router
    adaptive: str
    fixed: str
    model: Path


@pytest.fixture
async def mesh(
    tiny_llama_dir: Path, tmp_path: Path, start_gateway: StartGateway
) -> AsyncIterator[Mesh]:
    worker = await start_worker(tiny_llama_dir, "colocated")
    pools = tmp_path / "pools.yaml"
    pools.write_text(yaml.safe_dump({"tiers": [{"name": "tiny", "colocated": [worker.address]}]}))
    flags = ["--config", str(pools), "--port", "0", "--metrics-port", "-1"]
    router = build_router(load_config(RouterConfig, [*flags, "--refresh-interval-s", "0.1"]))
    await router.start()
    common = [
        "--router", router.server.address, "--model-path", f"tiny={tiny_llama_dir}",
        "--catalog-refresh-s", "0.1", "--max-in-flight", "1", "--batch-max-in-flight", "1",
    ]  # fmt: skip
    adaptive = await start_gateway(common)
    fixed = await start_gateway([*common, "--no-adaptive-admission"])
    try:
        yield Mesh(worker, router, adaptive, fixed, tiny_llama_dir)
    finally:
        await router.stop()
        await worker.stop()


async def measured_rates(client: kvmesh.Client) -> ServiceRates:
    """Runs requests until the gateway reports the rates the router measured."""
    rates: list[ServiceRates] = []

    async def reported() -> bool:
        await client.generate(PROMPT, max_tokens=8, ignore_eos=True, cache_policy="bypass")
        (info,) = await client.list_models()
        if info.HasField("service_rates"):
            rates.append(ServiceRates.from_proto(info.service_rates))
        return bool(rates)

    assert await wait_until(reported, within=20.0)
    return rates[-1]


async def routed_s(mesh: Mesh, prompt_ids: list[int]) -> float:
    """Seconds the router takes for the long answer."""
    sampling = common_pb2.SamplingParams(max_tokens=LONG_ANSWER, ignore_eos=True)
    async with grpc.aio.insecure_channel(mesh.router.server.address) as channel:
        started = time.monotonic()
        result = await route(
            router_pb2_grpc.RouterStub(channel), request("measure", prompt_ids, sampling)
        )
        assert result.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
        return time.monotonic() - started


async def hopeless(client: kvmesh.Client, deadline_s: float) -> kvmesh.GenerationResult:
    """A long answer asked for while another request holds the gateway's one slot."""
    holder = client.stream(PROMPT, max_tokens=LONG_ANSWER, ignore_eos=True, cache_policy="bypass")
    async with holder:
        await anext(holder)  # it has the slot
        return await client.generate(
            PROMPT,
            max_tokens=LONG_ANSWER,
            ignore_eos=True,
            cache_policy="bypass",
            deadline_s=deadline_s,
        )


async def test_a_request_that_cannot_finish_in_time_is_shed_at_once(mesh: Mesh) -> None:
    async with kvmesh.Client(mesh.adaptive) as client:
        rates = await measured_rates(client)
        assert rates.decode_s_per_token > 0 and rates.prefill_s_per_token > 0
        prompt_ids = Tokenizer.from_model_path(str(mesh.model)).encode(PROMPT)
        service_s = rates.service_s(len(prompt_ids), LONG_ANSWER)
        started = time.monotonic()
        await client.generate(PROMPT, max_tokens=8, ignore_eos=True, cache_policy="bypass")
        short_s = time.monotonic() - started
        # How long the answer takes here and now (straight from the router: neither gateway
        # learns from it) bounds the deadline below too, so that a slot holder outlasts it
        # however fast the machine is at the moment. Twice a short answer's time comes on top:
        # the gateway expects the slot's holder to take about that long (it learned its hold
        # time from short answers only), and a deadline within that wait alone would be
        # refused for the wait, not for the service time this test is about.
        deadline_s = 2 * short_s + min(service_s, await routed_s(mesh, prompt_ids)) / 2
        # The wait and half the time the workers need for it: refused before anything runs.
        with pytest.raises(ResourceExhausted) as raised:
            await hopeless(client, deadline_s)
        assert "expected time for this prompt and max_tokens" in str(raised.value)
        assert raised.value.retry_after_s is not None and raised.value.retry_after_s > 0
    # The old admission queues the same request and lets it run into its deadline.
    async with kvmesh.Client(mesh.fixed) as client:
        late = await hopeless(client, deadline_s)
        assert late.finish_reason == "deadline"
        assert late.usage.completion_tokens < LONG_ANSWER
    assert await all_idle([mesh.worker.stub])
