"""gRPC face of a worker: Generate (colocated), Prefill / PullKv / ReleaseKv, Decode, Stats.

The worker streams no Started event (placement is the router's business): a generation stream
is TokenChunk* then Finished. A Decode stream's first chunk is the token the prefill worker
sampled, sent once the missing KV is imported, so it tells the router the hand-off succeeded.

Every path that takes KV blocks gives them back: a finished or aborted request frees its
blocks in the engine; a Cancel message or a broken stream closes the engine's output iterator,
which aborts; a failed import is cancelled; an unpulled lease expires.

A worker defends itself even against a mesh member gone wrong: a lease lives at most the
worker's TTL and serves only the members it was granted for; a pull names each block once and
is read a few blocks at a time; a decode dials only the address of a lease this stack signed
and writes only blocks whose keyed digest binds them to that lease (mesh_keys.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from kvmesh.channels import insecure_channel
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
from kvmesh.mesh_auth import MeshMember, MeshRole, caller_of
from kvmesh.mesh_keys import MeshKeys
from kvmesh.rpc_status import error_from_rpc
from kvmesh.streams import CancelWatch, Coalescer, first_message, run_unless_cancelled
from kvmesh.telemetry import tracer
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker import metrics
from services.worker.config import WorkerConfig
from services.worker.convert import engine_request, finished, layout_proto, token_chunk
from services.worker.engine.kv_cache_manager import KvCapacityError
from services.worker.engine.request import (
    EngineRequest,
    FinishReason,
    ImportPlan,
    RequestOutput,
)
from services.worker.kv_transfer import BlockAssembler, Pacer, check_compatible, chunk_block
from services.worker.leases import Lease, LeaseTable

if TYPE_CHECKING:
    from services.worker.backends import EngineBackend

log = logging.getLogger(__name__)
_tracer = tracer(__name__)

PULL_READ_BYTES = 8 << 20
"""Most KV bytes a PullKv reads out of the engine at once (at least one block): a pull of any
size holds this much, not the whole lease."""

_ROLES = {
    "prefill": worker_pb2.WORKER_ROLE_PREFILL,
    "decode": worker_pb2.WORKER_ROLE_DECODE,
    "both": worker_pb2.WORKER_ROLE_BOTH,
}


def _cancel_reason(
    message: worker_pb2.WorkerGenerateMessage | worker_pb2.DecodeMessage,
) -> str | None:
    return message.cancel.reason if message.WhichOneof("message") == "cancel" else None


@dataclass(slots=True)
class _StreamState:
    """One generation stream: what it has sent, and what must be undone if it stops early."""

    request_id: str
    prompt_tokens: int
    finished: bool = False
    """The engine finished the request (or it was already stopped and its blocks freed)."""
    import_plan: ImportPlan | None = None
    """The decode's import, cancelled if the stream stops before its commit ran."""
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_sent_at: float | None = None

    def aborted(self, kv_transfer_ms: float = 0.0) -> common_pb2.Finished:
        now = time.monotonic()
        return common_pb2.Finished(
            finish_reason=common_pb2.FINISH_REASON_ABORT,
            usage=common_pb2.Usage(
                prompt_tokens=self.prompt_tokens,
                cached_prompt_tokens=self.cached_prompt_tokens,
                completion_tokens=self.output_tokens,
            ),
            timings=common_pb2.Timings(
                ttft_ms=self.ttft_ms,
                e2e_ms=(now - self.started) * 1000,
                kv_transfer_ms=kv_transfer_ms,
            ),
        )

    @property
    def ttft_ms(self) -> float:
        return 0.0 if self.first_token_at is None else (self.first_token_at - self.started) * 1000


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Implements kvmesh.v1.Worker over one engine backend (native or vLLM)."""

    def __init__(
        self,
        engine: EngineBackend,
        config: WorkerConfig,
        leases: LeaseTable,
        address: Callable[[], str],
        keys: MeshKeys,
    ) -> None:
        self.engine = engine
        self.config = config
        self.leases = leases
        self.keys = keys
        self._address = address
        self.layout = layout_proto(engine.layout)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._background: set[asyncio.Task[object]] = set()

    # ---- colocated ------------------------------------------------------------------------

    async def Generate(
        self,
        request_iterator: AsyncIterator[worker_pb2.WorkerGenerateMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        # The request is read before a refusal: a client's write racing the end of the call
        # fails on its side as INTERNAL (grpc aio), hiding the refusal's status.
        first = await first_message(request_iterator, "request")
        self._require(self.config.role == "both", "Generate", "both")
        if first.WhichOneof("message") != "request":
            raise InvalidArgument("request", "the first message must be the request")
        request = engine_request(first.request, context.time_remaining())
        watch = CancelWatch(request_iterator, _cancel_reason, request.request_id)
        watch.start()
        state = self._track(request, context)
        try:
            async for event in self._stream(
                "Generate", self.engine.generate(request), watch.cancelled, state
            ):
                yield event
        finally:
            await watch.close()

    # ---- prefill side ---------------------------------------------------------------------

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        self._require(self.config.serves_prefill, "Prefill", "prefill or both")
        engine_req = engine_request(request.request, context.time_remaining())
        started = time.monotonic()
        # If this RPC is cancelled meanwhile, the engine aborts the prefill and frees its blocks.
        with _engine_errors():
            output, handle = await self.engine.prefill_and_hold(engine_req)
        metrics.REQUEST_PREFILL_SECONDS.labels("Prefill").observe(time.monotonic() - started)
        response = worker_pb2.PrefillResponse(
            first_token=token_chunk([output]),
            cached_prompt_tokens=output.num_cached_prompt_tokens,
        )
        if handle is None:
            elapsed_ms = (time.monotonic() - started) * 1000
            response.finished.CopyFrom(finished(output, ttft_ms=elapsed_ms, e2e_ms=elapsed_ms))
            self._count_finished("Prefill", output.finish_reason)
            return response
        ttl_s = request.lease_ttl_ms / 1000 if request.lease_ttl_ms else None
        holders = {self._caller(context)} | ({request.puller} if request.puller else set())
        lease = self.leases.grant(
            handle.handle_id, handle.block_hashes, handle.num_tokens, frozenset(holders), ttl_s
        )
        metrics.LEASES.labels("granted").inc()
        metrics.LEASES_ACTIVE.set(len(self.leases))
        response.lease.CopyFrom(self._lease_proto(lease))
        context.add_done_callback(lambda ended: self._drop_if_undelivered(ended, lease))
        return response

    def _drop_if_undelivered(self, context: grpc.aio.ServicerContext, lease: Lease) -> None:
        """A lease whose Prefill response never reached the caller is released at once."""
        if not context.cancelled():
            return
        if self.leases.drop(lease.lease_id) is not None:
            self._spawn(self.release_lease(lease))
            metrics.LEASES.labels("released").inc()

    def _lease_proto(self, lease: Lease) -> common_pb2.KvLease:
        proto = common_pb2.KvLease(
            lease_id=lease.lease_id,
            worker_address=self._address(),
            block_hashes=lease.block_hashes,
            num_tokens=lease.num_tokens,
            model_fingerprint=self.engine.fingerprint,
            layout=self.layout,
            expires_unix_ms=lease.expires_unix_ms,
        )
        proto.signature = self.keys.sign_lease(proto)
        return proto

    async def PullKv(
        self, request: worker_pb2.PullKvRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvChunk]:
        self._require(self.config.serves_prefill, "PullKv", "prefill or both")
        lease = self.leases.get(request.lease_id, self._caller(context))
        check_compatible(
            self.engine.fingerprint, self.layout, request.model_fingerprint, request.layout
        )
        indices = _pull_indices(request.block_indices, len(lease.block_hashes))
        pacer = Pacer(self.config.kv_send_max_mb_s * 1e6)
        # Read off the engine thread (held blocks do not change), so a pull does not wait for
        # the engine's current step; a few blocks per read keep the thread hops few and the
        # bytes held at once bounded, whatever the pull's size.
        per_read = max(1, PULL_READ_BYTES // max(1, self.engine.layout.block_bytes))
        for start in range(0, len(indices), per_read):
            group = indices[start : start + per_read]
            try:
                blobs = await self.engine.export_blocks(lease.handle_id, group)
            except KeyError:
                raise NotFound(f"KV lease {request.lease_id!r} expired during the pull") from None
            for index, data in zip(group, blobs, strict=True):
                metrics.KV_TRANSFER_BYTES.labels("sent").inc(len(data))
                metrics.KV_TRANSFER_BLOCKS.labels("sent").inc()
                block_hash = lease.block_hashes[index]
                digest = self.keys.block_digest(lease.lease_id, index, block_hash, data)
                for chunk in chunk_block(
                    index, block_hash, data, digest, self.config.kv_chunk_bytes
                ):
                    yield chunk
                    await pacer.sent(len(chunk.data))
            del blobs

    async def ReleaseKv(
        self, request: worker_pb2.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseKvResponse:
        self._require(self.config.serves_prefill, "ReleaseKv", "prefill or both")
        lease = self.leases.take(request.lease_id, self._caller(context))
        released = await self.release_lease(lease)
        metrics.LEASES.labels("released").inc()
        return worker_pb2.ReleaseKvResponse(blocks_released=released)

    async def release_lease(self, lease: Lease) -> int:
        """Unpins a lease's blocks in the engine (already taken out of the table)."""
        metrics.LEASES_ACTIVE.set(len(self.leases))
        try:
            return await self.engine.release(lease.handle_id)
        except KeyError:
            return 0

    async def expire_lease(self, lease: Lease) -> None:
        """The lease sweeper's release callback."""
        await self.release_lease(lease)
        metrics.LEASES.labels("expired").inc()

    # ---- decode side ----------------------------------------------------------------------

    async def Decode(
        self,
        request_iterator: AsyncIterator[worker_pb2.DecodeMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        first = await first_message(request_iterator, "start")  # before a refusal: see Generate
        self._require(self.config.serves_decode, "Decode", "decode or both")
        if first.WhichOneof("message") != "start":
            raise InvalidArgument("start", "the first message must be the start")
        start = first.start
        if len(start.first_token.token_ids) != 1:
            raise InvalidArgument("first_token", "must carry exactly the one token prefill sampled")
        request = engine_request(start.request, context.time_remaining())
        lease = start.lease
        check_compatible(
            self.engine.fingerprint, self.layout, lease.model_fingerprint, lease.layout
        )
        if not self.keys.lease_is_signed(lease):
            # Nothing is dialled for a lease this stack did not sign: its address is a
            # caller's word, and its blocks would reach the prefix cache.
            raise PermissionDenied(
                "lease: the signature does not verify (not granted by a worker of this stack)"
            )
        state = self._track(request, context)
        watch = CancelWatch(request_iterator, _cancel_reason, request.request_id)
        watch.start()
        try:
            plan = state.import_plan = await self._start_import(request, lease)
            try:
                pulled = await run_unless_cancelled(
                    self._pull_missing(plan, lease, context.time_remaining()), watch.cancelled
                )
            except BaseException:
                await self.engine.cancel_import(plan)
                raise
            if pulled is None:
                await self.engine.cancel_import(plan)
                state.finished = True
                yield common_pb2.GenerateEvent(finished=state.aborted())
                return
            kv_transfer_ms = (time.monotonic() - state.started) * 1000
            self._spawn(self._release_remote(lease))
            async for event in self._stream(
                "Decode",
                self.engine.commit_import(plan, start.first_token.token_ids[0]),
                watch.cancelled,
                state,
                kv_transfer_ms,
                lead=start.first_token,
            ):
                yield event
        finally:
            await watch.close()

    async def _start_import(self, request: EngineRequest, lease: common_pb2.KvLease) -> ImportPlan:
        task = asyncio.ensure_future(
            self.engine.start_import(request, list(lease.block_hashes), lease.num_tokens)
        )
        try:
            # Shielded: if this RPC is cancelled meanwhile, an import the engine still makes
            # is cancelled once it exists, instead of holding its blocks for good.
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._cancel_orphan_import)
            raise
        except KvCapacityError as error:
            raise ResourceExhausted(f"decode worker KV cache is full: {error}") from None
        except ValueError as error:
            raise InvalidArgument("lease", str(error)) from None

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

    async def _release_remote(self, lease: common_pb2.KvLease) -> None:
        """Ends the lease on its worker; if this fails, the lease's TTL frees the blocks."""
        stub = worker_pb2_grpc.WorkerStub(self._channel(lease.worker_address))
        try:
            await stub.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=lease.lease_id), timeout=5.0)
        except grpc.aio.AioRpcError as error:
            log.info("ReleaseKv %s on %s: %s", lease.lease_id, lease.worker_address, error.code())

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            member = MeshMember(MeshRole.WORKER, self._address(), self.keys)
            channel = self._channels[address] = insecure_channel(address, member=member)
        return channel

    def _caller(self, context: grpc.aio.ServicerContext) -> str:
        """The mesh name of the call's verified caller ("" when it proves none)."""
        return caller_of(context, self.keys).name

    # ---- streaming ------------------------------------------------------------------------

    async def _stream(
        self,
        rpc: str,
        outputs: AsyncIterator[RequestOutput],
        cancelled: asyncio.Event,
        state: _StreamState,
        kv_transfer_ms: float = 0.0,
        lead: common_pb2.TokenChunk | None = None,
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        """`lead` (if any), coalesced chunks, then Finished.

        A Cancel, a broken stream or an engine stream that ends without a finish reason stops
        the request and frees its blocks (see `_stop`).
        """
        batches = Coalescer(outputs)
        try:
            if lead is not None:
                self._observe_chunk(rpc, state, len(lead.token_ids))
                yield common_pb2.GenerateEvent(chunk=lead)
            while True:
                with _engine_errors():
                    batch = await run_unless_cancelled(anext(batches, None), cancelled)
                if batch is None:
                    # Cancelled, or the engine ended the stream without a finish reason.
                    self._count_finished(rpc, FinishReason.ABORT)
                    await self._stop(state)
                    yield common_pb2.GenerateEvent(finished=state.aborted(kv_transfer_ms))
                    return
                chunk = token_chunk(batch)
                last = batch[-1]
                state.cached_prompt_tokens = last.num_cached_prompt_tokens
                if chunk.token_ids:
                    self._observe_chunk(rpc, state, len(chunk.token_ids))
                    yield common_pb2.GenerateEvent(chunk=chunk)
                if last.finish_reason is not None:
                    state.finished = True
                    self._count_finished(rpc, last.finish_reason)
                    yield common_pb2.GenerateEvent(
                        finished=finished(
                            last,
                            kv_transfer_ms=kv_transfer_ms,
                            ttft_ms=state.ttft_ms,
                            e2e_ms=(time.monotonic() - state.started) * 1000,
                        )
                    )
                    return
        finally:
            await batches.aclose()
            await self._stop(state)

    def _track(self, request: EngineRequest, context: grpc.aio.ServicerContext) -> _StreamState:
        """State of a new stream; when the RPC ends unfinished, its request is stopped.

        gRPC may drop a handler whose client went away without resuming it, so the cleanup is
        tied to the end of the RPC as well as to the handler's own exit.
        """
        state = _StreamState(request.request_id, len(request.prompt_token_ids))
        context.add_done_callback(lambda _: self._spawn(self._stop(state)))
        return state

    async def _stop(self, state: _StreamState) -> None:
        """Aborts a request that did not finish; frees an import that was never committed.

        Engine commands run in order, so the abort follows any commit still queued; the
        cancel_import then fails harmlessly when the commit did run. Safe to repeat.
        """
        if state.finished:
            return
        state.finished = True
        await self.engine.abort(state.request_id)
        if state.import_plan is not None:
            with contextlib.suppress(KeyError):
                await self.engine.cancel_import(state.import_plan)

    def _cancel_orphan_import(self, task: asyncio.Future[ImportPlan]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._spawn(self.engine.cancel_import(task.result()))

    @staticmethod
    def _observe_chunk(rpc: str, state: _StreamState, num_tokens: int) -> None:
        now = time.monotonic()
        if state.first_token_at is None:
            state.first_token_at = now
            metrics.REQUEST_PREFILL_SECONDS.labels(rpc).observe(now - state.started)
        elif state.last_sent_at is not None:
            gap = (now - state.last_sent_at) / num_tokens
            for _ in range(num_tokens):
                metrics.INTER_TOKEN_LATENCY.labels(rpc).observe(gap)
        state.last_sent_at = now
        state.output_tokens += num_tokens
        metrics.GENERATION_TOKENS.labels(rpc).inc(num_tokens)

    @staticmethod
    def _count_finished(rpc: str, reason: FinishReason | None) -> None:
        metrics.REQUESTS_FINISHED.labels(rpc, (reason or FinishReason.ABORT).value).inc()

    # ---- stats ----------------------------------------------------------------------------

    async def Stats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        stats = self.engine.stats()
        queried = stats.prefix_queries_tokens
        return worker_pb2.WorkerStats(
            role=_ROLES[self.config.role],
            model=self.config.tier or self.engine.model_name,
            model_fingerprint=self.engine.fingerprint,
            running=stats.running,
            waiting=stats.waiting,
            kv_blocks_free=stats.kv_blocks_free,
            kv_blocks_total=stats.kv_blocks_total,
            block_size=stats.block_size,
            prefix_cache_hit_rate=stats.prefix_hit_tokens / queried if queried else 0.0,
            cached_block_hashes=stats.cached_block_hashes if request.include_block_hashes else [],
            num_cached_blocks=len(stats.cached_block_hashes),
            active_leases=len(self.leases),
            tokens_per_second=stats.tokens_per_second,
            layout=self.layout,
            context_length=self.engine.context_length,
        )

    def refresh_gauges(self) -> None:
        """Copies the engine's load into the Prometheus gauges (called by the lease sweeper)."""
        stats = self.engine.stats()
        metrics.REQUESTS_RUNNING.set(stats.running)
        metrics.REQUESTS_WAITING.set(stats.waiting)
        if stats.kv_blocks_total:
            used = stats.kv_blocks_total - stats.kv_blocks_free
            metrics.KV_CACHE_USAGE.set(used / stats.kv_blocks_total)
        if stats.prefix_queries_tokens:
            metrics.PREFIX_CACHE_HIT_RATE.set(stats.prefix_hit_tokens / stats.prefix_queries_tokens)
        metrics.LEASES_ACTIVE.set(len(self.leases))

    # ---- lifecycle ------------------------------------------------------------------------

    async def close(self) -> None:
        """Releases every lease and closes the channels to other workers (at shutdown)."""
        for lease in self.leases.take_all():
            await self.release_lease(lease)
        for task in list(self._background):
            task.cancel()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    def _spawn(self, work: Coroutine[Any, Any, object]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _require(self, allowed: bool, rpc: str, roles: str) -> None:
        if not allowed:
            raise FailedPrecondition(
                f"{rpc} needs a worker of role {roles}; this one is {self.config.role!r}"
            )


def _pull_indices(requested: Sequence[int], count: int) -> list[int]:
    """The blocks a PullKv asks for (all when none are named), each named once and in range."""
    if not requested:
        return list(range(count))
    indices = list(requested)
    if len(set(indices)) != len(indices):
        raise InvalidArgument("block_indices", "each block may be asked for once")
    out_of_range = [i for i in indices if i >= count]
    if out_of_range:
        shown = out_of_range[:8]
        raise InvalidArgument(
            "block_indices",
            f"{len(out_of_range)} out of range for a {count}-block lease (e.g. {shown})",
        )
    return indices


@contextlib.contextmanager
def _engine_errors() -> Iterator[None]:
    """The engine's refusals as the caller's errors: bad input, or no room for the KV."""
    try:
        yield
    except KvCapacityError as error:
        raise ResourceExhausted(f"KV cache cannot hold the request: {error}") from None
    except ConstraintError as error:
        raise InvalidArgument(error.field, error.detail) from None
    except ValueError as error:
        raise InvalidArgument("request", str(error)) from None


def _pull_error(error: grpc.aio.AioRpcError, address: str) -> KvmeshError:
    """The typed error of a failed PullKv; transport failures name the prefill worker."""
    typed = error_from_rpc(error)
    if isinstance(typed, Unavailable | NotFound | DataLoss | FailedPrecondition | DeadlineExceeded):
        typed.message = f"pulling KV from {address}: {typed.message}"
        return typed
    return Unavailable(f"pulling KV from {address} failed: {error.code().name} {error.details()}")
