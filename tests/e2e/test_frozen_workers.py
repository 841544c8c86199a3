"""Workers that freeze (SIGSTOP: their sockets stay open, nothing answers) before their first
token, and the keepalive that gives up on a frozen peer."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from kvmesh.channels import KEEPALIVE_TIME_MS, PING_TIMEOUT_MS, member_channel
from kvmesh.v1 import common_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.e2e.split_stack import Stack
from tests.service.worker_mesh import GREEDY, offline, request, route

pytestmark = pytest.mark.e2e


async def test_a_prefill_worker_frozen_before_its_first_token_is_retried_within_5_s(
    stack: Stack, tiny_llama_dir: Path
) -> None:
    """SIGSTOP of the prefill worker that holds the prompt's prefix, just before a request
    for it: the router places it there (nothing is noticed yet), sees the worker leave the
    rotation and runs the prompt on the other one; the answer is whole within 5 s."""
    prompt = list(range(300, 340))
    (expected,) = offline(tiny_llama_dir, [prompt], GREEDY)
    async with grpc.aio.insecure_channel(stack.router.address) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        warm = await route(router, request("warm-freeze-p", prompt), 30)
        holder = next(
            p for p in stack.prefill if p.address == warm.started.placement.prefill_worker
        )
        other = next(p for p in stack.prefill if p is not holder)
        os.kill(holder.proc.pid, signal.SIGSTOP)
        try:
            sent = time.monotonic()
            result = await route(router, request("freeze-p", prompt), 30)
            took = time.monotonic() - sent
        finally:
            os.kill(holder.proc.pid, signal.SIGCONT)
    assert took < 5.0, took
    placement = result.started.placement
    assert (placement.attempts, placement.prefill_worker) == (2, other.address)
    assert result.token_ids == expected
    assert result.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_keepalive_fails_a_call_to_a_frozen_peer_within_its_15_s(stack: Stack) -> None:
    """A call on a connected kvmesh channel to a worker that then freezes (SIGSTOP: its
    socket stays open, nothing answers) fails UNAVAILABLE once a ping (keepalive's every
    10 s, also while the call sends no data) goes unanswered for 5 s: within 15 s (before:
    the keepalive ping's 60 s timeout of grpc.http2.ping_timeout_ms; with grpc's defaults
    no keepalive at all, and the call waits for ever)."""
    frozen = stack.prefill[0]
    async with member_channel(frozen.address, None, traced=False) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        await stub.Stats(worker_pb2.StatsRequest(), timeout=5)  # connected
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        try:
            sent = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await asyncio.wait_for(stub.Stats(worker_pb2.StatsRequest()), 25)
            took = time.monotonic() - sent
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value
    assert took <= (KEEPALIVE_TIME_MS + PING_TIMEOUT_MS) / 1000 + 2, took
