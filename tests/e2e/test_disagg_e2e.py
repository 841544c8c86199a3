"""Workers and router as real processes: a worker killed during the hand-off or mid-stream."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.e2e.split_stack import LEASE_TTL_S, Stack
from tests.procs import ServiceProcess
from tests.service.worker_mesh import GREEDY, all_idle, offline, request, route

PROMPT = list(range(20, 220))  # 200 tokens: 13 blocks, about 106 kB of KV
SENT = re.compile(r'^kvmesh:kv_transfer_bytes_total\{direction="sent"\} (\S+)$', re.MULTILINE)


def _bytes_sent(process: ServiceProcess) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics") as reply:
        found = SENT.search(reply.read().decode())
    return float(found.group(1)) if found else 0.0


async def _kill_when_sending(
    candidates: list[ServiceProcess], baseline: list[float]
) -> ServiceProcess:
    """SIGKILLs the first worker seen sending KV (a PullKv in progress)."""
    while True:
        for process, before in zip(candidates, baseline, strict=True):
            if await asyncio.to_thread(_bytes_sent, process) > before:
                process.kill()
                return process
        await asyncio.sleep(0.02)


async def test_prefill_killed_during_pull_is_resumed_on_the_other(
    stack: Stack, tiny_llama_dir: Path
) -> None:
    (expected,) = offline(tiny_llama_dir, [PROMPT], GREEDY)
    baseline = [_bytes_sent(p) for p in stack.prefill]
    async with grpc.aio.insecure_channel(stack.router.address) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(timeout=60)
        await call.write(router_pb2.RouteMessage(request=request("kill-p", PROMPT, model="tiny")))
        killed = await _kill_when_sending(stack.prefill, baseline)
        events = [event async for event in call]
    survivor = next(p for p in stack.prefill if p is not killed)
    # The first token went out before the pull, from the killed worker's prefill ...
    placement = events[0].started.placement
    assert (placement.attempts, placement.prefill_worker) == (1, killed.address)
    # ... and the stream continues after it, with nothing sent twice.
    tokens = [t for e in events if e.WhichOneof("event") == "chunk" for t in e.chunk.token_ids]
    assert tokens == expected
    assert events[-1].finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert events[-1].finished.usage.completion_tokens == len(expected)

    # The resumed placement, its reason and the failed attempt are on the router's span.
    span = await _router_span(stack.trace_file, "kill-p")
    attributes = span["attributes"]
    assert attributes["kvmesh.placement.attempts"] == 2
    assert f"retry after UNAVAILABLE on {killed.address}" in attributes["kvmesh.placement.reason"]
    assert attributes["kvmesh.placement.prefill_worker"] == survivor.address
    assert attributes["gen_ai.request.model"] == "tiny"
    assert attributes["gen_ai.usage.output_tokens"] == len(expected)
    (retry,) = [e for e in span["events"] if e["name"] == "kvmesh.retry"]
    assert killed.address in retry["attributes"]["kvmesh.failed_workers"]
    async with (
        grpc.aio.insecure_channel(survivor.address) as prefill,
        grpc.aio.insecure_channel(stack.decode.address) as decode,
    ):
        stubs = [worker_pb2_grpc.WorkerStub(prefill), worker_pb2_grpc.WorkerStub(decode)]
        assert await all_idle(stubs)


async def _router_span(trace_file: Path, request_id: str) -> dict[str, Any]:
    """The router.generate span of a request (spans are written when they end)."""
    for _ in range(100):
        if trace_file.exists():
            for line in trace_file.read_text().splitlines():
                span = json.loads(line)
                attributes = span.get("attributes", {})
                if (
                    span["name"] == "router.generate"
                    and attributes.get("kvmesh.request_id") == request_id
                ):
                    return dict(span)
        await asyncio.sleep(0.05)
    raise AssertionError(f"no router.generate span for {request_id} in {trace_file}")


async def test_a_frozen_decode_worker_fails_its_stream_within_5_s(stack: Stack) -> None:
    """SIGSTOP of the decode worker mid-stream (it stops answering but its connections stay
    open): the router takes it out of rotation and ends the stream UNAVAILABLE with the usage
    so far within 5 s (before: about 60 s, when HTTP/2 keepalive gave up)."""
    long_output = common_pb2.SamplingParams(max_tokens=400, ignore_eos=True)
    prompt = PROMPT[:20]
    frozen_at = 0.0
    async with grpc.aio.insecure_channel(stack.router.address) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(timeout=60)
        await call.write(
            router_pb2.RouteMessage(request=request("freeze-d", prompt, long_output, model="tiny"))
        )
        received = 0
        try:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for event in call:
                    received += len(event.chunk.token_ids)
                    if received and not frozen_at:
                        os.kill(stack.decode.proc.pid, signal.SIGSTOP)
                        frozen_at = time.monotonic()
            failed_after = time.monotonic() - frozen_at
        finally:
            os.kill(stack.decode.proc.pid, signal.SIGCONT)
    assert failed_after < 5.0, failed_after
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    details = raised.value.details() or ""
    assert "left the rotation" in details and "usage so far" in details, details
    # Back in rotation once it answers again: the next request is served.
    deadline = time.monotonic() + 20
    while True:
        try:
            async with grpc.aio.insecure_channel(stack.router.address) as channel:
                result = await route(
                    router_pb2_grpc.RouterStub(channel), request("after-freeze", prompt), 30
                )
            break
        except grpc.aio.AioRpcError:
            assert time.monotonic() < deadline, "the thawed decode worker did not come back"
            await asyncio.sleep(0.2)
    assert result.finished.finish_reason in (
        common_pb2.FINISH_REASON_LENGTH,
        common_pb2.FINISH_REASON_STOP,
    )


async def test_decode_killed_mid_stream_is_unavailable_and_the_lease_is_freed(
    stack: Stack,
) -> None:
    long_output = common_pb2.SamplingParams(max_tokens=400, ignore_eos=True)
    prompt = PROMPT[:20]
    async with grpc.aio.insecure_channel(stack.router.address) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(timeout=60)
        await call.write(
            router_pb2.RouteMessage(request=request("kill-d", prompt, long_output, model="tiny"))
        )
        received = 0
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for event in call:
                received += len(event.chunk.token_ids)
                if received and stack.decode.proc.poll() is None:
                    stack.decode.kill()
                    killed_at = time.monotonic()
    assert time.monotonic() - killed_at < 2.0
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    details = raised.value.details() or ""
    assert "not re-run" in details
    used = re.search(r"usage so far: prompt_tokens=(\d+) .* completion_tokens=(\d+)", details)
    assert used is not None
    assert int(used.group(1)) == len(prompt)
    assert received <= int(used.group(2)) < 400

    live = [p for p in stack.prefill if p.proc.poll() is None]
    channels = [grpc.aio.insecure_channel(p.address) for p in live]
    try:
        stubs = [worker_pb2_grpc.WorkerStub(c) for c in channels]
        # Every lease ends (pulled and released, or freed by its 1 s TTL); no block stays.
        assert await all_idle(stubs, within=float(LEASE_TTL_S) + 2.0)
        stats = [await s.Stats(worker_pb2.StatsRequest()) for s in stubs]
        assert all(s.active_leases == 0 for s in stats)
    finally:
        for channel in channels:
            await channel.close()


def test_workers_yield_the_cpu_to_the_services_beside_them(stack: Stack) -> None:
    # Each worker lowered its own priority by --nice (default 10); the router did not. The
    # tests before this one kill workers of the module's stack: the live ones are asked.
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    alive = [w for w in [*stack.prefill, stack.decode] if w.proc.poll() is None]
    assert alive
    for worker in alive:
        assert os.getpriority(os.PRIO_PROCESS, worker.proc.pid) == min(ours + 10, 19)
    assert os.getpriority(os.PRIO_PROCESS, stack.router.proc.pid) == ours
