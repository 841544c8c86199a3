"""gRPC face of a worker: Generate and GenerateMany (colocated), Prefill / PullKv / ReleaseKv,
Decode, Stats.

Protobuf in, a call into the engine, the KV exporter (prefill side: leases and their blocks) or
the KV importer (decode side: pulling a lease's blocks), protobuf out.

The worker streams no Started event (placement is the router's business): a generation stream
is TokenChunk* then Finished. A Decode stream's first chunk is the token the prefill worker
sampled, sent once the missing KV is imported, so it tells the router the hand-off succeeded.

Every path that takes KV blocks gives them back: a finished or aborted request frees its
blocks in the engine; a Cancel message or a broken stream closes the engine's output iterator,
which aborts; a failed import is cancelled; an unpulled lease expires.

A worker defends itself even against a mesh member gone wrong: a lease lives at most the
worker's TTL and serves only the members it was granted for; a pull names each block once and
is read a few blocks at a time (kv_exporter.py); a decode dials only the address of a lease this
stack signed and writes only blocks whose keyed digest binds them to that lease (kv_importer.py,
mesh_keys.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kvmesh.contracts.constraints import ConstraintError
from kvmesh.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from kvmesh.mesh_auth import caller_of
from kvmesh.mesh_keys import MeshKeys
from kvmesh.serve_many import serve_many
from kvmesh.streams import CancelWatch, Coalescer, first_message
from kvmesh.telemetry import tracer
from kvmesh.timings import request_timings
from kvmesh.tls import TlsFiles
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.version import kvmesh_version
from services.worker import metrics
from services.worker.config import WorkerConfig
from services.worker.convert import (
    engine_request,
    finished,
    layout_proto,
    sampled_chunk,
    sampled_token,
    token_chunk,
)
from services.worker.engine.api import (
    EngineRequest,
    FinishReason,
    ImportPlan,
    KvCapacityError,
    RequestOutput,
)
from services.worker.kv_exporter import KvExporter
from services.worker.kv_importer import KvImporter
from services.worker.kv_transfer import check_compatible
from services.worker.leases import LeaseTable

if TYPE_CHECKING:
    from services.worker.engine.api import EngineBackend

log = logging.getLogger(__name__)

Holder = TypeVar("Holder")
_tracer = tracer(__name__)

_ROLES = {
    "prefill": worker_pb2.WORKER_ROLE_PREFILL,
    "decode": worker_pb2.WORKER_ROLE_DECODE,
    "colocated": worker_pb2.WORKER_ROLE_COLOCATED,
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

    def timings(self, kv_transfer_ms: float = 0.0) -> common_pb2.Timings:
        return request_timings(self.started, self.first_token_at, kv_transfer_ms=kv_transfer_ms)

    def aborted(self, kv_transfer_ms: float = 0.0) -> common_pb2.Finished:
        return common_pb2.Finished(
            finish_reason=common_pb2.FINISH_REASON_ABORT,
            usage=common_pb2.Usage(
                prompt_tokens=self.prompt_tokens,
                cached_prompt_tokens=self.cached_prompt_tokens,
                completion_tokens=self.output_tokens,
            ),
            timings=self.timings(kv_transfer_ms),
        )


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Implements kvmesh.v1.Worker over one engine backend (native or vLLM)."""

    def __init__(
        self,
        engine: EngineBackend,
        config: WorkerConfig,
        leases: LeaseTable,
        address: Callable[[], str],
        keys: MeshKeys,
        tls: TlsFiles | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.leases = leases
        self.keys = keys
        self.layout = layout_proto(engine.layout)
        self._background: set[asyncio.Task[object]] = set()
        self.exporter = KvExporter(
            engine,
            leases,
            self.layout,
            address,
            keys,
            self._spawn,
            chunk_bytes=config.kv_chunk_bytes,
            send_max_bytes_s=config.kv_send_max_mb_s * 1e6,
        )
        self.importer = KvImporter(engine, self.layout, address, keys, self._spawn, tls)
        self._request_ids: dict[str, object] = {}
        """Request id -> the call running it: a second call under an id in use is refused
        before it can touch the first (its cleanup would abort the engine request by id)."""

    # ---- colocated ------------------------------------------------------------------------

    async def Generate(
        self,
        request_iterator: AsyncIterator[worker_pb2.WorkerGenerateMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        # The request is read before a refusal: a client's write racing the end of the call
        # fails on its side as INTERNAL (grpc aio), hiding the refusal's status.
        first = await first_message(request_iterator, "request")
        self._require(self.config.role == "colocated", "Generate", "colocated")
        if first.WhichOneof("message") != "request":
            raise InvalidArgument("request", "the first message must be the request")
        request = engine_request(first.request, context.time_remaining())
        # Claimed before the watch starts: a refused duplicate leaves no reader task behind
        # (it would fail on the aborted call with nobody to retrieve its error).
        state = self._track(request, context)
        watch = CancelWatch(request_iterator, _cancel_reason, request.request_id)
        watch.start()
        try:
            async for event in self._stream(
                "Generate", self.engine.generate(request), watch.cancelled, state
            ):
                yield event
        finally:
            await watch.close()

    async def GenerateMany(
        self,
        request_iterator: AsyncIterator[common_pb2.GenerateManyMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[common_pb2.GenerateManyEvents]:
        first = await first_message(request_iterator, "request")  # before a refusal: see Generate
        self._require(self.config.role == "colocated", "GenerateMany", "colocated")
        method = "/kvmesh.v1.Worker/Generate"
        many = serve_many(
            first, request_iterator, context, method, self._many_generation, self._spawn
        )
        async for events in many:
            yield events

    async def _many_generation(
        self,
        message: common_pb2.GenerateManyMessage,
        cancelled: asyncio.Event,
        timeout_s: float | None,
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        """One generation of a GenerateMany stream, as Generate runs it."""
        request = engine_request(message.request, timeout_s)
        state = self._track(request)
        async for event in self._stream(
            "Generate", self.engine.generate(request), cancelled, state
        ):
            yield event

    # ---- prefill side ---------------------------------------------------------------------

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        self._require(self.config.serves_prefill, "Prefill", "prefill or colocated")
        engine_req = engine_request(request.request, context.time_remaining())
        started = time.monotonic()
        claim = self._claim_id(engine_req.request_id, object())
        try:
            # If this RPC is cancelled meanwhile, the engine aborts the prefill and frees its
            # blocks.
            with _engine_errors():
                output, handle = await self.engine.prefill_and_hold(engine_req)
        finally:
            self._free_id(engine_req.request_id, claim)
        metrics.REQUEST_PREFILL_SECONDS.labels("Prefill").observe(time.monotonic() - started)
        response = worker_pb2.PrefillResponse(
            first_token=token_chunk([output]),
            sampled=sampled_chunk(output),
            cached_prompt_tokens=output.num_cached_prompt_tokens,
        )
        if handle is None:  # ended with the prompt: its first token, if any, is all there is
            first_token_at = time.monotonic() if output.new_token_ids else None
            timings = request_timings(started, first_token_at)
            response.finished.CopyFrom(finished(output, timings=timings))
            self._count_finished("Prefill", output.finish_reason)
            return response
        ttl_s = request.lease_ttl_ms / 1000 if request.lease_ttl_ms else None
        holders = {self._caller(context)} | ({request.puller} if request.puller else set())
        lease = self.exporter.grant(handle, frozenset(holders), ttl_s)
        response.lease.CopyFrom(lease)
        context.add_done_callback(lambda ended: self._drop_if_undelivered(ended, lease.lease_id))
        return response

    def _drop_if_undelivered(self, context: grpc.aio.ServicerContext, lease_id: str) -> None:
        """A lease whose Prefill response never reached the caller is released at once."""
        if context.cancelled():
            self.exporter.release_undelivered(lease_id)

    async def PullKv(
        self, request: worker_pb2.PullKvRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvChunk]:
        self._require(self.config.serves_prefill, "PullKv", "prefill or colocated")
        chunks = self.exporter.blocks(
            request.lease_id,
            self._caller(context),
            request.block_indices,
            request.model_fingerprint,
            request.layout,
        )
        async for chunk in chunks:
            yield chunk

    async def ReleaseKv(
        self, request: worker_pb2.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseKvResponse:
        self._require(self.config.serves_prefill, "ReleaseKv", "prefill or colocated")
        released = await self.exporter.release(request.lease_id, self._caller(context))
        return worker_pb2.ReleaseKvResponse(blocks_released=released)

    # ---- decode side ----------------------------------------------------------------------

    async def Decode(
        self,
        request_iterator: AsyncIterator[worker_pb2.DecodeMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        first = await first_message(request_iterator, "start")  # before a refusal: see Generate
        self._require(self.config.serves_decode, "Decode", "decode or colocated")
        if first.WhichOneof("message") != "start":
            raise InvalidArgument("start", "the first message must be the start")
        start = first.start
        first_token_id, first_logprob = sampled_token(start.sampled)
        request = engine_request(start.request, context.time_remaining())
        lease = start.lease
        check_compatible(
            self.engine.fingerprint, self.layout, lease.model_fingerprint, lease.layout
        )
        self.importer.check_signed(lease)
        state = self._track(request, context)
        watch = CancelWatch(request_iterator, _cancel_reason, request.request_id)
        watch.start()
        try:
            plan = state.import_plan = await self.importer.start(request, lease)
            pulled = await self.importer.fill(
                plan, lease, watch.cancelled, context.time_remaining()
            )
            if pulled is None:
                state.finished = True
                yield common_pb2.GenerateEvent(finished=state.aborted())
                return
            kv_transfer_ms = (time.monotonic() - state.started) * 1000
            self._spawn(self.importer.release_remote(lease))
            async for event in self._stream(
                "Decode",
                self.engine.commit_import(plan, first_token_id, first_logprob),
                watch.cancelled,
                state,
                kv_transfer_ms,
                lead=start.first_token,
            ):
                yield event
        finally:
            await watch.close()

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
        batches.interrupt_when(cancelled)
        try:
            if lead is not None:
                self._observe_chunk(rpc, state, len(lead.token_ids))
                yield common_pb2.GenerateEvent(chunk=lead)
            while True:
                with _engine_errors():
                    batch = await anext(batches, None)
                if batch is None:
                    # Cancelled, or the engine ended the stream without a finish reason.
                    self._count_finished(rpc, FinishReason.ABORT)
                    await self._stop(state)
                    yield common_pb2.GenerateEvent(finished=state.aborted(kv_transfer_ms))
                    return
                chunk = token_chunk(batch)
                last = batch[-1]
                state.cached_prompt_tokens = last.num_cached_prompt_tokens
                if chunk.token_ids or chunk.text:
                    self._observe_chunk(rpc, state, len(chunk.token_ids))
                    yield common_pb2.GenerateEvent(chunk=chunk)
                if last.finish_reason is not None:
                    state.finished = True
                    self._count_finished(rpc, last.finish_reason)
                    yield common_pb2.GenerateEvent(
                        finished=finished(last, timings=state.timings(kv_transfer_ms))
                    )
                    return
        finally:
            await batches.aclose()
            await self._stop(state)

    def _track(
        self, request: EngineRequest, context: grpc.aio.ServicerContext | None = None
    ) -> _StreamState:
        """State of a new stream; when the RPC ends unfinished, its request is stopped.

        gRPC may drop a handler whose client went away without resuming it, so the cleanup is
        tied to the end of the RPC (`context`) as well as to the handler's own exit. A
        GenerateMany generation has no RPC of its own: its task's exit stops it, and the
        stream's end cancels every such task.
        """
        state = self._claim_id(
            request.request_id, _StreamState(request.request_id, len(request.prompt_token_ids))
        )
        if context is not None:
            context.add_done_callback(lambda _: self._spawn(self._stop(state)))
        return state

    def _claim_id(self, request_id: str, holder: Holder) -> Holder:
        """Holds `request_id` for `holder`, one call (AlreadyExists while another holds it)."""
        if request_id in self._request_ids:
            raise AlreadyExists(f"request id {request_id!r} is already in use on this worker")
        self._request_ids[request_id] = holder
        return holder

    def _free_id(self, request_id: str, holder: object) -> None:
        if self._request_ids.get(request_id) is holder:
            del self._request_ids[request_id]

    async def _stop(self, state: _StreamState) -> None:
        """Aborts a request that did not finish; frees an import that was never committed.

        Engine commands run in order, so the abort follows any commit still queued; the
        cancel_import then fails harmlessly when the commit did run. Safe to repeat.
        """
        if not state.finished:
            state.finished = True
            await self.engine.abort(state.request_id)
            if state.import_plan is not None:
                with contextlib.suppress(KeyError):
                    await self.engine.cancel_import(state.import_plan)
        # Free for another call only once the abort is done: it names the request by id.
        self._free_id(state.request_id, state)

    @staticmethod
    def _observe_chunk(rpc: str, state: _StreamState, num_tokens: int) -> None:
        if not num_tokens:  # the rest of a held-back token's text: no token goes out
            return
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
            peak_tokens_per_second=stats.peak_tokens_per_second,
            layout=self.layout,
            context_length=self.engine.context_length,
            kvmesh_version=kvmesh_version(),
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
        await self.exporter.close()
        for task in list(self._background):
            task.cancel()
        await self.importer.close()

    def _spawn(self, work: Coroutine[Any, Any, object]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _require(self, allowed: bool, rpc: str, roles: str) -> None:
        if not allowed:
            raise FailedPrecondition(
                f"{rpc} needs a worker of role {roles}; this one is {self.config.role!r}"
            )


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
