"""The decode side of the KV hand-off: plan an import, pull the blocks it lacks, release the lease.

After the scheduler half of vLLM's KV connector: the engine's `start_import` tells which blocks
of a KvLease its prefix cache already holds (an ImportPlan); this module pulls the rest from the
lease's worker over PullKv, writes each block whose keyed digest binds it to the lease as it
arrives, and leaves the commit (or the cancel) of the import to the caller. It dials only the
address of a lease this stack signed, over its own channel cache to the prefill workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import grpc

from kvmesh.channels import member_channel
from kvmesh.contracts.constraints import ConstraintError
from kvmesh.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvmeshError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from kvmesh.mesh_auth import MeshMember, MeshRole
from kvmesh.mesh_keys import MeshKeys
from kvmesh.rpc_status import error_from_rpc
from kvmesh.streams import run_unless_cancelled
from kvmesh.telemetry import tracer
from kvmesh.tls import TlsFiles
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker import metrics
from services.worker.engine.api import EngineRequest, ImportPlan, KvCapacityError
from services.worker.kv_transfer import BlockAssembler

if TYPE_CHECKING:
    from services.worker.engine.api import EngineBackend

log = logging.getLogger(__name__)
_tracer = tracer(__name__)


class KvImporter:
    """Imports leased KV from other workers into one engine."""

    def __init__(
        self,
        engine: EngineBackend,
        layout: common_pb2.KvLayout,
        address: Callable[[], str],
        keys: MeshKeys,
        spawn: Callable[[Coroutine[Any, Any, object]], None],
        tls: TlsFiles | None = None,
    ) -> None:
        self.engine = engine
        self.layout = layout
        self._address = address
        self.keys = keys
        self._tls = tls
        self._spawn = spawn
        self._channels: dict[str, grpc.aio.Channel] = {}

    def check_signed(self, lease: common_pb2.KvLease) -> None:
        """PermissionDenied unless a worker of this stack signed the lease.

        Nothing is dialled for a lease this stack did not sign: its address is a caller's word,
        and its blocks would reach the prefix cache."""
        if not self.keys.lease_is_signed(lease):
            raise PermissionDenied(
                "lease: the signature does not verify (not granted by a worker of this stack)"
            )

    async def start(self, request: EngineRequest, lease: common_pb2.KvLease) -> ImportPlan:
        """The engine's plan for the lease: blocks reserved, cached ones found."""
        task = asyncio.ensure_future(
            self.engine.start_import(request, list(lease.block_hashes), lease.num_tokens)
        )
        try:
            # Shielded: if the caller is cancelled meanwhile, an import the engine still makes
            # is cancelled once it exists, instead of holding its blocks for good.
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._cancel_orphan_import)
            raise
        except KvCapacityError as error:
            raise ResourceExhausted(f"decode worker KV cache is full: {error}") from None
        except ConstraintError as error:  # a constraint this engine cannot continue
            raise InvalidArgument(error.field, error.detail) from None
        except ValueError as error:
            raise InvalidArgument("lease", str(error)) from None

    async def fill(
        self,
        plan: ImportPlan,
        lease: common_pb2.KvLease,
        cancelled: asyncio.Event,
        time_left: float | None,
    ) -> int | None:
        """Pulls and writes the blocks the plan lacks; the bytes moved, or None when `cancelled`
        was set first. The import is cancelled in the engine when this does not succeed."""
        try:
            pulled = await run_unless_cancelled(
                self._pull_missing(plan, lease, time_left), cancelled
            )
        except BaseException:
            await self.engine.cancel_import(plan)
            raise
        if pulled is None:
            await self.engine.cancel_import(plan)
        return pulled

    async def _pull_missing(
        self, plan: ImportPlan, lease: common_pb2.KvLease, time_left: float | None
    ) -> int:
        """Pulls the blocks the plan lacks from the lease's worker; returns the bytes moved."""
        missing = plan.missing_indices
        if not missing:
            return 0
        started = time.monotonic()
        assembler = BlockAssembler(
            {i: lease.block_hashes[i] for i in missing},
            self.engine.layout.block_bytes,
            self.keys,
            lease.lease_id,
        )
        stub = worker_pb2_grpc.WorkerStub(self._channel(lease.worker_address))
        call = stub.PullKv(
            worker_pb2.PullKvRequest(
                lease_id=lease.lease_id,
                block_indices=missing,
                model_fingerprint=self.engine.fingerprint,
                layout=self.layout,
            ),
            timeout=time_left,
        )
        # Writes are queued without waiting for each, so writing a block overlaps receiving the
        # next (the native engine writes on copy threads, without waiting for its current step).
        writes: list[asyncio.Future[None]] = []
        with _tracer.start_as_current_span("kv_pull") as span:
            try:
                async for chunk in call:
                    block = assembler.add(chunk)
                    if block is not None:
                        writes.append(
                            asyncio.ensure_future(self.engine.write_imported_block(plan, *block))
                        )
                await asyncio.gather(*writes)
            except grpc.aio.AioRpcError as error:
                raise _pull_error(error, lease.worker_address) from None
            finally:
                call.cancel()
                # On failure, let queued writes settle before the caller cancels the import.
                await asyncio.gather(*writes, return_exceptions=True)
            if assembler.missing():
                raise DataLoss(f"PullKv ended before blocks {assembler.missing()} arrived")
            span.set_attribute("kvmesh.kv_transfer.bytes", assembler.bytes_received)
            span.set_attribute("kvmesh.kv_transfer.blocks", len(missing))
        metrics.KV_TRANSFER_SECONDS.observe(time.monotonic() - started)
        metrics.KV_TRANSFER_BYTES.labels("received").inc(assembler.bytes_received)
        metrics.KV_TRANSFER_BLOCKS.labels("received").inc(len(missing))
        return assembler.bytes_received

    async def release_remote(self, lease: common_pb2.KvLease) -> None:
        """Ends the lease on its worker; if this fails, the lease's TTL frees the blocks."""
        stub = worker_pb2_grpc.WorkerStub(self._channel(lease.worker_address))
        try:
            await stub.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=lease.lease_id), timeout=5.0)
        except grpc.aio.AioRpcError as error:
            log.info("ReleaseKv %s on %s: %s", lease.lease_id, lease.worker_address, error.code())

    async def close(self) -> None:
        """Closes the channels to other workers (at shutdown)."""
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            member = MeshMember(MeshRole.WORKER, self._address(), self.keys, self._tls)
            channel = self._channels[address] = member_channel(address, member)
        return channel

    def _cancel_orphan_import(self, task: asyncio.Future[ImportPlan]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._spawn(self.engine.cancel_import(task.result()))


def _pull_error(error: grpc.aio.AioRpcError, address: str) -> KvmeshError:
    """The typed error of a failed PullKv; transport failures name the prefill worker."""
    typed = error_from_rpc(error)
    if isinstance(typed, Unavailable | NotFound | DataLoss | FailedPrecondition | DeadlineExceeded):
        typed.message = f"pulling KV from {address}: {typed.message}"
        return typed
    return Unavailable(f"pulling KV from {address} failed: {error.code().name} {error.details()}")
