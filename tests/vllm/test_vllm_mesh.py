"""vLLM workers in the mesh: vLLM prefill -> vLLM decode, refusals, and nothing left held.

Workers: a vLLM worker of role colocated (prefill side and colocated reference), a vLLM decode
worker, and a native prefill worker (its 16-token blocks and byte order differ from vLLM's).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from kvmesh.mesh_keys import MeshKeys
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.service.worker_mesh import (
    GREEDY,
    InProcessWorker,
    all_idle,
    colocated,
    decode_start,
    disaggregated,
    prefill_request,
    request,
    start_worker,
    wait_until,
)
from tests.vllm.conftest import start_vllm_worker, vllm_engine

pytestmark = pytest.mark.asyncio(loop_scope="module")

# 40 tokens: one full 32-token block and a partial one; 70 tokens: two full and a partial.
PROMPTS = [list(range(20, 60)), list(range(100, 170))]
LONG = common_pb2.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
# As long as the tiny model's context allows: about a second of decoding here.
LONGEST = common_pb2.SamplingParams(max_tokens=470, temperature=0.0, ignore_eos=True)


@dataclass
class Mesh:
    vllm_both: InProcessWorker
    vllm_decode: InProcessWorker
    native_prefill: InProcessWorker

    @property
    def stubs(self) -> list[worker_pb2_grpc.WorkerStub]:
        return [self.vllm_both.stub, self.vllm_decode.stub, self.native_prefill.stub]

    def entries(self) -> int:
        """Entries still on disk on both vLLM workers (held leases, imports)."""
        return vllm_engine(self.vllm_both).num_entries + vllm_engine(self.vllm_decode).num_entries


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(tiny_llama32_dir: Path) -> AsyncIterator[Mesh]:
    workers = Mesh(
        await start_vllm_worker(tiny_llama32_dir, "colocated"),
        await start_vllm_worker(tiny_llama32_dir, "decode"),
        await start_worker(tiny_llama32_dir, "prefill"),
    )
    yield workers
    for worker in (workers.vllm_both, workers.vllm_decode, workers.native_prefill):
        await worker.stop()


async def settled(mesh: Mesh) -> bool:
    """Every worker idle (no request, lease or used block) and no vLLM entry left."""
    return await all_idle(mesh.stubs) and mesh.entries() == 0


async def test_vllm_prefill_to_vllm_decode_matches_colocated(mesh: Mesh) -> None:
    decode_engine = vllm_engine(mesh.vllm_decode)
    for index, prompt in enumerate(PROMPTS):
        alone = await colocated(mesh.vllm_both.stub, request(f"c{index}", prompt))
        loaded_before = decode_engine.kv_loaded_tokens
        split = await disaggregated(mesh.vllm_both, mesh.vllm_decode, request(f"s{index}", prompt))
        assert split.token_ids == alone.token_ids
        assert len(split.token_ids) == GREEDY.max_tokens
        assert split.text == alone.text
        assert split.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert split.finished.usage.completion_tokens == GREEDY.max_tokens
        assert split.finished.timings.kv_transfer_ms > 0
        # The decode worker computed none of the prompt: its KV came through the connector.
        assert decode_engine.kv_loaded_tokens - loaded_before == len(prompt)
    assert await settled(mesh)


async def test_native_prefill_to_vllm_decode_is_refused(mesh: Mesh) -> None:
    req = request("mixed", PROMPTS[0])
    prefilled = await mesh.native_prefill.stub.Prefill(prefill_request(req, mesh.vllm_decode))
    call = mesh.vllm_decode.stub.Decode(timeout=10)
    await call.write(decode_start(req, prefilled))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        _ = [event async for event in call]
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "KV layout mismatch" in (raised.value.details() or "")
    await mesh.native_prefill.stub.ReleaseKv(
        worker_pb2.ReleaseKvRequest(lease_id=prefilled.lease.lease_id)
    )
    assert await settled(mesh)


async def test_a_lease_never_pulled_is_freed_by_its_ttl(mesh: Mesh) -> None:
    prefilled = await mesh.vllm_both.stub.Prefill(
        prefill_request(request("idle", PROMPTS[1]), mesh.vllm_decode, lease_ttl_ms=300)
    )
    assert len(prefilled.lease.block_hashes) == 3
    assert vllm_engine(mesh.vllm_both).num_entries == 1
    assert await wait_until(lambda: settled(mesh), within=5)


async def test_cancelled_streams_leave_nothing_held(mesh: Mesh) -> None:
    generate = mesh.vllm_both.stub.Generate(timeout=30)
    await generate.write(
        worker_pb2.WorkerGenerateMessage(request=request("gen-cancel", PROMPTS[0], LONG))
    )
    prefilled = await mesh.vllm_both.stub.Prefill(
        prefill_request(request("dec-cancel", PROMPTS[1], LONG), mesh.vllm_decode)
    )
    decode = mesh.vllm_decode.stub.Decode(timeout=30)
    await decode.write(decode_start(request("dec-cancel", PROMPTS[1], LONG), prefilled))
    for call in (generate, decode):
        first = await call.read()
        assert first.WhichOneof("event") == "chunk"
    generate.cancel()
    await decode.write(worker_pb2.DecodeMessage(cancel=common_pb2.Cancel(reason="test")))
    event = await decode.read()
    while event.WhichOneof("event") == "chunk":
        event = await decode.read()
    assert event.finished.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert await wait_until(lambda: settled(mesh), within=5)


async def test_a_dead_prefill_peer_frees_the_import(mesh: Mesh) -> None:
    req = request("orphan", PROMPTS[1])
    prefilled = await mesh.vllm_both.stub.Prefill(prefill_request(req, mesh.vllm_decode))
    lease_id = prefilled.lease.lease_id
    prefilled.lease.worker_address = "127.0.0.1:9"  # nothing listens there
    # Signed as the stack (no mesh secret) would: a lease of a worker that died.
    prefilled.lease.signature = MeshKeys.from_secret("").sign_lease(prefilled.lease)
    call = mesh.vllm_decode.stub.Decode(timeout=10)
    await call.write(decode_start(req, prefilled))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        _ = [event async for event in call]
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert vllm_engine(mesh.vllm_decode).num_entries == 0
    await mesh.vllm_both.stub.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=lease_id))
    assert await asyncio.wait_for(settled(mesh), timeout=10)


async def test_deadline_ends_the_request_with_its_partial_output(mesh: Mesh) -> None:
    call = mesh.vllm_both.stub.Generate(timeout=0.25)
    await call.write(worker_pb2.WorkerGenerateMessage(request=request("late", PROMPTS[0], LONGEST)))
    events = [event async for event in call]
    finished = events[-1].finished
    assert finished.finish_reason == common_pb2.FINISH_REASON_DEADLINE
    streamed = sum(len(event.chunk.token_ids) for event in events[:-1])
    assert finished.usage.completion_tokens == streamed < LONGEST.max_tokens
    assert await wait_until(lambda: settled(mesh), within=5)
