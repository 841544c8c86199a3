"""`kvmesh bench`: drives a gateway with Poisson arrivals and measures every stream."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import grpc

from kvmesh.bench_report import RequestResult
from kvmesh.client import gateway_channel
from kvmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

Workload = Literal["random", "prefix", "mixed"]

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
    "under pale moonlight near ancient rivers where merchants trade silver spices and woven cloth "
    "for maps of distant mountains covered in snow and legends about forgotten kingdoms"
).split()


@dataclass(slots=True, frozen=True)
class LoadSpec:
    """What to send and how fast."""

    num_requests: int = 100
    """Requests in the run."""
    rate: float = math.inf
    """Mean arrivals per second (Poisson); inf sends as fast as concurrency allows."""
    concurrency: int = 0
    """Most requests in flight at once; 0 means unbounded."""
    workload: Workload = "random"
    """random prompts, a shared prefix with random suffixes, or a mix of short and long."""
    input_words: int = 64
    """Words per prompt (the suffix, with workload prefix)."""
    prefix_words: int = 512
    """Words in the shared prefix (workload prefix)."""
    output_tokens: int = 64
    """max_tokens of every request (EOS is ignored so every request produces them all)."""
    model: str = ""
    """Model tier; empty takes the gateway's default."""
    seed: int = 0
    """Seed of prompts and arrival times."""
    api_key: str = ""
    """Bearer key sent to the gateway."""


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def build_requests(spec: LoadSpec) -> list[gateway_pb2.GenerateRequest]:
    """The run's requests, reproducible from the seed."""
    rng = random.Random(spec.seed)
    prefix = _words(random.Random(spec.seed + 1), spec.prefix_words)
    requests = []
    for index in range(spec.num_requests):
        priority = common_pb2.PRIORITY_INTERACTIVE
        text = _words(rng, spec.input_words)
        if spec.workload == "prefix":
            text = f"{prefix} {text}"
        elif spec.workload == "mixed" and rng.random() < 0.25:
            text = _words(rng, spec.input_words * 8)
            priority = common_pb2.PRIORITY_BATCH
        requests.append(
            gateway_pb2.GenerateRequest(
                request_id=f"bench-{spec.seed}-{index}",
                model=spec.model,
                prompt=common_pb2.Prompt(text=text),
                sampling=common_pb2.SamplingParams(
                    max_tokens=spec.output_tokens, temperature=0.0, ignore_eos=True
                ),
                priority=priority,
                cache_policy=common_pb2.CACHE_POLICY_BYPASS,
            )
        )
    return requests


def arrival_gaps(spec: LoadSpec) -> list[float]:
    """Seconds to wait before each request (exponential gaps for a Poisson process)."""
    if math.isinf(spec.rate):
        return [0.0] * spec.num_requests
    rng = random.Random(spec.seed + 2)
    return [rng.expovariate(spec.rate) for _ in range(spec.num_requests)]


async def measure(
    stub: gateway_pb2_grpc.GatewayStub,
    request: gateway_pb2.GenerateRequest,
    metadata: tuple[tuple[str, str], ...],
    start_s: float,
) -> RequestResult:
    """Sends one request and times its stream."""
    result = RequestResult(ok=False, start_s=start_s)
    sent = time.perf_counter()
    last_chunk = sent
    call = stub.Generate(metadata=metadata)
    try:
        await call.write(gateway_pb2.GenerateClientMessage(request=request))
        await call.done_writing()
        async for event in call:
            kind = event.WhichOneof("event")
            now = time.perf_counter()
            if kind == "chunk" and event.chunk.token_ids:
                if result.output_tokens == 0:
                    result.ttft_s = now - sent
                else:
                    result.itl_s.append(now - last_chunk)
                last_chunk = now
                result.output_tokens += len(event.chunk.token_ids)
            elif kind == "finished":
                result.prompt_tokens = event.finished.usage.prompt_tokens
                result.finish_reason = common_pb2.FinishReason.Name(event.finished.finish_reason)
                result.ok = event.finished.finish_reason != common_pb2.FINISH_REASON_ERROR
                result.error = event.finished.error_message
        result.e2e_s = time.perf_counter() - sent
    except grpc.aio.AioRpcError as error:
        result.error = f"{error.code().name}: {error.details()}"
    return result


async def run_load(
    target: str,
    spec: LoadSpec,
    on_done: Callable[[RequestResult], None],
    ca_file: Path | None = None,
) -> tuple[list[RequestResult], float]:
    """Sends every request on its Poisson schedule (over TLS verified with `ca_file` when
    given); returns the results and the run's duration."""
    requests = build_requests(spec)
    gaps = arrival_gaps(spec)
    metadata = (("authorization", f"Bearer {spec.api_key}"),) if spec.api_key else ()
    limit = asyncio.Semaphore(spec.concurrency) if spec.concurrency > 0 else None
    # Untraced: the load generator records no spans, and a client interceptor on every call
    # would add its own latency to every TTFT measured.
    async with gateway_channel(target, ca_file) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        zero = time.perf_counter()

        async def one(request: gateway_pb2.GenerateRequest) -> RequestResult:
            async with limit if limit is not None else contextlib.nullcontext():
                result = await measure(stub, request, metadata, time.perf_counter() - zero)
            on_done(result)
            return result

        tasks = []
        for request, gap in zip(requests, gaps, strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - zero
