"""The admission pipeline of one request, and the gateway's Usage and ListModels answers.

Generate: authorize -> validate -> (idempotent replay) -> tenant concurrency -> reserve the
token budget -> response cache -> admission queue -> router -> settle, meter, store -> Finished.
The servicer only turns gRPC into these calls.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterable, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from kvmesh.contracts.constraints import checked_constraint
from kvmesh.contracts.sampling import AUTO_MODEL, is_deterministic
from kvmesh.errors import (
    AlreadyExists,
    DeadlineExceeded,
    KvmeshError,
    NotFound,
    QuotaViolation,
    ResourceExhausted,
)
from kvmesh.streams import run_unless_cancelled
from kvmesh.telemetry import tracer
from kvmesh.tenants import PriorityClass, Tenant, TenantRegistry
from kvmesh.v1 import cache_pb2, common_pb2, gateway_pb2
from services.admission import metrics
from services.admission.admission_queue import AdmissionQueue, Ticket
from services.admission.auth import (
    authenticate,
    authorize_model,
    authorize_priority,
    authorize_usage_read,
)
from services.admission.catalog import ModelCatalog, ModelSpec, TokenizerLike
from services.admission.concurrency import ConcurrencyLimits, Slot
from services.admission.downstream import CacheClient, RouterClient
from services.admission.holdings import Holdings
from services.admission.idempotency import Claim, IdempotencyStore
from services.admission.metering import ModelTotals, UsageMeter
from services.admission.pricing import PriceTable, TokenCounts, request_cost
from services.admission.quotas import Quotas, Reservation
from services.admission.tool_calls import ToolPlan, answer_calls, constrain_answer, plan_tools
from services.admission.transcript import Transcript, cache_hit_chunks
from services.admission.validation import (
    RequestLimits,
    check_envelope,
    checked_sampling,
    prompt_chars,
    prompt_token_ids,
)

log = logging.getLogger(__name__)
REQUEST_LOG = "kvmesh.requests"
"""The logger of the one line per finished request; INFO only with --log-requests."""
request_log = logging.getLogger(REQUEST_LOG)
_tracer = tracer(__name__)

DEADLINE_MARGIN_S = 0.5
"""Most time kept back from the caller's deadline to send the partial answer before it."""
DEADLINE_MARGIN_FRACTION = 0.2
"""Share of the caller's time kept back, up to DEADLINE_MARGIN_S."""
INLINE_TOKENIZE_CHARS = 4096
"""Longer prompts are tokenized on a thread so they do not stall other requests."""
TOKENIZING_PER_TENANT = 2
"""Most long prompts of one tenant tokenized (or chat-rendered) at once; the rest wait."""

_PROTO_PRIORITY = {
    PriorityClass.INTERACTIVE: common_pb2.PRIORITY_INTERACTIVE,
    PriorityClass.BATCH: common_pb2.PRIORITY_BATCH,
}


_MEASURED = (
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_TOOL_CALLS,
    common_pb2.FINISH_REASON_DEADLINE,
)
"""Ends whose latency per token tells the concurrency limit how fast the workers serve."""


class ClientCancelled(Exception):
    """The client sent Cancel before the request reached the router."""


@dataclass(slots=True)
class Job:
    """A validated request and everything decided about it before it runs."""

    tenant: Tenant
    request_id: str
    model: ModelSpec
    tokenizer: TokenizerLike
    prompt_ids: list[int]
    sampling: common_pb2.SamplingParams
    priority: PriorityClass
    cache_policy: int
    labels: dict[str, str]
    stop_at: float | None
    """time.monotonic() at which the request must end, with a margin before the deadline."""
    tool_plan: ToolPlan | None = None
    """The answer is constrained to (or may end with) a tool call, returned parsed
    (tool_calls.py); None: no tool constrains it."""

    @property
    def budget_tokens(self) -> int:
        return len(self.prompt_ids) + self.sampling.max_tokens


class Gateway:
    """Everything behind the Gateway service; see the module docstring for the order."""

    def __init__(
        self,
        *,
        tenants: TenantRegistry,
        catalog: ModelCatalog,
        router: RouterClient,
        cache: CacheClient | None,
        quotas: Quotas,
        concurrency: ConcurrencyLimits,
        meter: UsageMeter,
        queue: AdmissionQueue,
        prices: PriceTable,
        limits: RequestLimits,
        idempotency: IdempotencyStore[Transcript],
    ) -> None:
        self.tenants = tenants
        self.catalog = catalog
        self.router = router
        self.cache = cache
        self.quotas = quotas
        self.concurrency = concurrency
        self.meter = meter
        self.queue = queue
        self.prices = prices
        self.limits = limits
        self.idempotency = idempotency
        self._background: set[asyncio.Task[None]] = set()
        self._tokenizing: dict[str, asyncio.Semaphore] = {}
        self._request_ids: set[tuple[str, str]] = set()
        """(tenant, client request id) of the requests in flight here."""

    def _tokenizing_slot(self, tenant: str) -> asyncio.Semaphore:
        """The bound on one tenant's long prompts tokenized at once."""
        slot = self._tokenizing.get(tenant)
        if slot is None:
            slot = self._tokenizing[tenant] = asyncio.Semaphore(TOKENIZING_PER_TENANT)
        return slot

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]]) -> Tenant:
        return authenticate(self.tenants, metadata)

    async def generate(
        self,
        tenant: Tenant,
        request: gateway_pb2.GenerateRequest,
        cancelled: asyncio.Event,
        time_remaining_s: float | None,
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        """Runs one request; events Started, TokenChunk*, Finished (or raises a KvmeshError)."""
        arrived = time.monotonic()
        job = await self._prepare(tenant, request, arrived, time_remaining_s)
        transcript = Transcript(job.request_id, job.model.id, len(job.prompt_ids), arrived)
        claim: Claim[Transcript] | None = None
        if request.idempotency_key:
            claimed = await self.idempotency.claim(
                tenant.name, request.idempotency_key, _fingerprint(request)
            )
            if isinstance(claimed, Transcript):
                for event in claimed.replay():
                    yield event
                return
            claim = claimed
        key = (tenant.name, job.request_id)
        try:
            if key in self._request_ids:
                raise AlreadyExists(f"request id {job.request_id!r} is already in flight")
            self._request_ids.add(key)
            try:
                async with aclosing(self._admit_and_run(job, transcript, cancelled)) as events:
                    async for event in events:
                        yield event
            finally:
                self._request_ids.discard(key)
        finally:
            if claim is not None:
                if transcript.is_complete_answer():
                    self.idempotency.finish(claim, transcript)
                else:
                    self.idempotency.abandon(claim)

    async def _prepare(
        self,
        tenant: Tenant,
        request: gateway_pb2.GenerateRequest,
        arrived: float,
        time_remaining_s: float | None,
    ) -> Job:
        envelope = check_envelope(request)
        model = await self.catalog.resolve(request.model)
        authorize_model(tenant, model.id)
        priority = envelope.priority if envelope.priority is not None else tenant.highest_priority
        authorize_priority(tenant, priority)
        tokenizer = await self.catalog.tokenizer(model)
        tools = plan_tools(request.prompt.chat) if request.prompt.HasField("chat") else None
        if prompt_chars(request.prompt) > INLINE_TOKENIZE_CHARS:
            # Off the event loop, and at most TOKENIZING_PER_TENANT of a tenant's at once: a
            # stream of long prompts holds a few threads, not the gateway.
            async with self._tokenizing_slot(tenant.name):
                prompt_ids = await asyncio.to_thread(
                    prompt_token_ids, request.prompt, tokenizer, model, tools
                )
        else:
            prompt_ids = prompt_token_ids(request.prompt, tokenizer, model, tools)
        sampling = checked_sampling(
            request.sampling,
            prompt_tokens=len(prompt_ids),
            model=model,
            vocab_size=tokenizer.vocab_size,
            limits=self.limits,
        )
        tool_plan = tools if tools is not None and constrain_answer(tools, sampling) else None
        if tool_plan is not None:
            checked_constraint(sampling)  # the tools' schemas are bounded like any schema
        return Job(
            tenant=tenant,
            request_id=request.request_id or uuid.uuid4().hex,
            model=model,
            tokenizer=tokenizer,
            prompt_ids=prompt_ids,
            sampling=sampling,
            priority=priority,
            cache_policy=envelope.cache_policy,
            labels=dict(request.labels),
            stop_at=_stop_at(arrived, time_remaining_s),
            tool_plan=tool_plan,
        )

    async def _admit_and_run(
        self, job: Job, transcript: Transcript, cancelled: asyncio.Event
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        holdings = Holdings(self._in_background)
        try:
            if job.tenant.max_concurrent:
                # Held for the whole request.
                await holdings.take(
                    self._tenant_slot(job.tenant), self.concurrency.release, interruptible=False
                )
            reservation = await holdings.take(
                self.quotas.reserve(job.tenant, job.budget_tokens),
                # An error, or the client went away: charge what reached it, if anything.
                lambda unsettled: self._abandon_books(job, transcript, unsettled),
                interruptible=False,
            )
            answer = self._answer(job, transcript, reservation, holdings, cancelled)
            async with aclosing(answer) as events:
                async for event in events:
                    yield event
        finally:
            await holdings.release_all()

    async def _answer(
        self,
        job: Job,
        transcript: Transcript,
        reservation: Reservation,
        holdings: Holdings,
        cancelled: asyncio.Event,
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        key = self._cache_key(job)
        try:
            async with aclosing(self._produce(job, transcript, key, holdings, cancelled)) as events:
                async for event in events:
                    yield event
        except ClientCancelled:
            transcript.finish(common_pb2.FINISH_REASON_ABORT)
        for event in transcript.ensure_started():
            yield event
        # On a task of its own: a cancel landing now must not lose the settle half done.
        await asyncio.shield(self._in_background(self._close_books(job, transcript, reservation)))
        if (
            key is not None
            and not transcript.response_cache_hit
            and transcript.is_complete_answer()
            and self._stored_tier(job, transcript)
        ):
            await self._store(key, transcript)
        if job.tool_plan is not None:
            _as_tool_calls(transcript, job.tool_plan)
        yield common_pb2.GenerateEvent(finished=transcript.finished)

    async def _produce(
        self,
        job: Job,
        transcript: Transcript,
        key: cache_pb2.CacheKey | None,
        holdings: Holdings,
        cancelled: asyncio.Event,
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        """Started and chunks from the cache or the router; leaves transcript.finished set."""
        if key is not None and job.cache_policy == common_pb2.CACHE_POLICY_USE:
            hit = await run_unless_cancelled(self._lookup(key), cancelled)
            if cancelled.is_set():
                raise ClientCancelled
            if hit is not None:
                for event in self._stream_hit(job, transcript, hit):
                    yield event
                return
        try:
            ticket = await run_unless_cancelled(
                holdings.take(
                    self.queue.admit(job.priority, job.stop_at, _service_s(job)),
                    self.queue.release,
                    interruptible=True,
                ),
                cancelled,
            )
        except DeadlineExceeded:
            transcript.finish(common_pb2.FINISH_REASON_DEADLINE)
            return
        if ticket is None or cancelled.is_set():
            raise ClientCancelled
        transcript.queue_s = ticket.queued_s
        try:
            async with aclosing(self._route(job, transcript, ticket, cancelled)) as events:
                async for event in events:
                    yield event
        finally:
            # What the concurrency limit learns: the pace of a whole answer or of one that ran
            # into its deadline (a cancelled or failed answer says nothing about the workers).
            reason = transcript.finished.finish_reason if transcript.finished else None
            ticket.measured = reason in _MEASURED
            ticket.output_tokens = len(transcript.token_ids)
            ticket.requested_tokens = job.sampling.max_tokens
            ticket.missed_deadline = reason == common_pb2.FINISH_REASON_DEADLINE
            if ticket.output_tokens:
                ticket.expected_s = _service_s(job, ticket.output_tokens)
            await holdings.give_back(ticket)

    async def _route(
        self, job: Job, transcript: Transcript, ticket: Ticket, cancelled: asyncio.Event
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        """Streams the router's answer; leaves transcript.finished set."""
        span = _tracer.start_span("admission.route", attributes=_span_attributes(job))
        timeout = None if job.stop_at is None else max(job.stop_at - time.monotonic(), 0.001)
        with trace.use_span(span, end_on_exit=False):
            stream = self.router.generate(self._inference_request(job), timeout)
        watcher = asyncio.ensure_future(_cancel_when_set(cancelled, stream.cancel))
        try:
            async for event in stream.events():
                kind = event.WhichOneof("event")
                if kind == "started":
                    event.started.queue_ms = ticket.queued_s * 1000.0
                    yield transcript.start(event.started)
                elif kind == "chunk":
                    for started in transcript.ensure_started():
                        yield started
                    yield self._observe_chunk(job, transcript, event.chunk)
                elif kind == "finished":
                    # Read on to the end of the call: the router ends it right after Finished,
                    # and cutting a call that is still open would look like a cancel.
                    transcript.finished = event.finished
        except DeadlineExceeded:
            transcript.finish(common_pb2.FINISH_REASON_DEADLINE)
        except KvmeshError as error:
            if transcript.started is None:
                raise
            # Tokens may have been streamed: never retried, the client gets what there is.
            transcript.finish(common_pb2.FINISH_REASON_ERROR, str(error))
        finally:
            watcher.cancel()
            stream.close()
            _end_span(span, transcript)
        if transcript.finished is None:
            reason = "cancelled" if cancelled.is_set() else "router ended the stream early"
            transcript.finish(
                common_pb2.FINISH_REASON_ABORT
                if cancelled.is_set()
                else common_pb2.FINISH_REASON_ERROR,
                "" if cancelled.is_set() else reason,
            )

    def _observe_chunk(
        self, job: Job, transcript: Transcript, chunk: common_pb2.TokenChunk
    ) -> common_pb2.GenerateEvent:
        first = transcript.first_token_at is None
        event = transcript.add(chunk)
        if first and transcript.first_token_at is not None:
            metrics.TIME_TO_FIRST_TOKEN.labels(transcript.model, job.priority.name.lower()).observe(
                transcript.first_token_at - transcript.arrived
            )
        return event

    def _stream_hit(
        self, job: Job, transcript: Transcript, hit: cache_pb2.CachedResponse
    ) -> Iterator[common_pb2.GenerateEvent]:
        transcript.response_cache_hit = True
        yield transcript.start(common_pb2.Started(model=hit.model or job.model.id, cache_hit=True))
        for chunk in cache_hit_chunks(hit, job.tokenizer):
            yield self._observe_chunk(job, transcript, chunk)
        transcript.finish(hit.finish_reason)

    async def _close_books(
        self,
        job: Job,
        transcript: Transcript,
        reservation: Reservation,
    ) -> None:
        """Prices the request, settles its budget and meters it; completes transcript.finished."""
        if transcript.finished is None:
            transcript.finish(common_pb2.FINISH_REASON_ABORT)
        finished = transcript.finished
        assert finished is not None
        counts = transcript.counts()
        spec = self.catalog.known(transcript.model) or job.model
        price = self.prices.price(spec.id, spec.usd_per_gpu_hour, spec.tokens_per_second)
        cost = request_cost(price, counts)
        finished.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=counts.prompt_tokens,
                cached_prompt_tokens=counts.cached_prompt_tokens,
                completion_tokens=counts.completion_tokens,
                response_cache_hit=transcript.response_cache_hit,
                cost_usd=cost,
            )
        )
        finished.timings.CopyFrom(transcript.timings(finished.timings.kv_transfer_ms))
        used = (
            0 if transcript.response_cache_hit else counts.prompt_tokens + counts.completion_tokens
        )
        await self.quotas.settle(reservation, used)
        await self.meter.record(
            job.tenant.name, transcript.model, ModelTotals.of_request(counts, cost)
        )
        labels = (transcript.model, job.priority.name.lower())
        metrics.E2E_LATENCY.labels(*labels).observe(time.monotonic() - transcript.arrived)
        metrics.QUEUE_TIME.labels(job.priority.name.lower()).observe(transcript.queue_s)
        reason = common_pb2.FinishReason.Name(finished.finish_reason).removeprefix("FINISH_REASON_")
        metrics.REQUESTS_FINISHED.labels(transcript.model, reason.lower()).inc()
        log_finished_request(job.tenant.name, transcript, counts, finished, reason.lower())

    def _cache_key(self, job: Job) -> cache_pb2.CacheKey | None:
        """The response-cache key, or None when this request must not touch the cache."""
        if (
            self.cache is None
            or job.cache_policy == common_pb2.CACHE_POLICY_BYPASS
            or not is_deterministic(job.sampling)
            or job.sampling.HasField("logprobs")  # stored answers keep no logprobs
            or job.model.id == AUTO_MODEL  # the tier is chosen later, by load too
            or not job.model.fingerprint  # without it a new model could serve old answers
        ):
            return None
        return cache_pb2.CacheKey(
            model=job.model.id,
            model_fingerprint=job.model.fingerprint,
            prompt_token_ids=job.prompt_ids,
            sampling=job.sampling,
            tenant=job.tenant.name,
            shared=job.tenant.shared_cache,
        )

    @staticmethod
    def _stored_tier(job: Job, transcript: Transcript) -> bool:
        """Only answers of the requested tier are stored (not a fallback tier's)."""
        placement = transcript.started.placement if transcript.started is not None else None
        return transcript.model == job.model.id and not (placement and placement.fallback)

    async def _lookup(self, key: cache_pb2.CacheKey) -> cache_pb2.CachedResponse | None:
        assert self.cache is not None
        return await self.cache.lookup(key)

    async def _store(self, key: cache_pb2.CacheKey, transcript: Transcript) -> None:
        assert self.cache is not None
        await self.cache.store(key, transcript.cached_response())

    def _inference_request(self, job: Job) -> common_pb2.InferenceRequest:
        return common_pb2.InferenceRequest(
            request_id=mesh_request_id(job.tenant.name, job.request_id),
            model=job.model.id,
            prompt_token_ids=job.prompt_ids,
            sampling=job.sampling,
            priority=_PROTO_PRIORITY[job.priority],
            cache_salt=job.tenant.salt,
            tenant=job.tenant.name,
            labels=job.labels,
        )

    async def _tenant_slot(self, tenant: Tenant) -> Slot:
        """One of the tenant's max_concurrent slots (counted across gateways on one Redis)."""
        slot = await self.concurrency.acquire(tenant.name, tenant.max_concurrent)
        if slot is None:
            description = f"concurrent requests: {tenant.max_concurrent} of {tenant.max_concurrent}"
            raise ResourceExhausted(
                f"tenant {tenant.name!r} has too many requests in flight ({description})",
                retry_after_s=max(self.queue.expected_wait_s(PriorityClass.INTERACTIVE), 0.1),
                quota_violations=(QuotaViolation(f"tenant:{tenant.name}", description),),
            )
        return slot

    async def _abandon_books(
        self, job: Job, transcript: Transcript, reservation: Reservation
    ) -> None:
        """A request that ended without Finished: charge what reached the client, if anything."""
        if reservation.settled:
            return
        if transcript.token_ids:
            await self._close_books(job, transcript, reservation)
        else:
            await self.quotas.release(reservation)

    def _in_background(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Runs bookkeeping off the request's task (which a cancel may interrupt); close()
        waits for it."""
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def usage(self, tenant: Tenant, target: str) -> gateway_pb2.UsageResponse:
        """The metered usage of `target` (the caller when empty)."""
        name = target or tenant.name
        authorize_usage_read(tenant, name)
        subject = self.tenants.by_name(name)
        if subject is None:
            raise NotFound(f"no tenant named {name!r}")
        totals = await self.meter.totals(name)
        minute, day = await self.quotas.used(subject)
        response = gateway_pb2.UsageResponse(
            tenant=name,
            tokens_this_minute=minute,
            tokens_today=day,
            tokens_per_minute_limit=subject.tokens_per_minute,
            daily_token_limit=subject.daily_tokens,
            cost_usd=sum(t.cost_usd for t in totals.values()),
        )
        for model, summed in sorted(totals.items()):
            response.models.append(
                gateway_pb2.ModelUsage(
                    model=model,
                    requests=summed.requests,
                    usage=gateway_pb2.UsageTotals(
                        prompt_tokens=summed.prompt_tokens,
                        cached_prompt_tokens=summed.cached_prompt_tokens,
                        completion_tokens=summed.completion_tokens,
                        response_cache_hits=summed.response_cache_hits,
                        response_cache_tokens=summed.response_cache_tokens,
                        cost_usd=summed.cost_usd,
                    ),
                )
            )
        return response

    async def list_models(self) -> gateway_pb2.ListModelsResponse:
        """The router's tiers, priced by this gateway's price table."""
        response = gateway_pb2.ListModelsResponse()
        for spec in await self.catalog.models():
            price = self.prices.price(spec.id, spec.usd_per_gpu_hour, spec.tokens_per_second)
            response.models.append(
                gateway_pb2.ModelInfo(
                    id=spec.id,
                    base_model=spec.base_model,
                    quantization=spec.quantization,
                    fingerprint=spec.fingerprint,
                    usd_per_gpu_hour=price.usd_per_gpu_hour,
                    tokens_per_second=price.tokens_per_second,
                    usd_per_1k_tokens=price.usd_per_1k_tokens,
                    context_length=spec.context_length,
                    available=spec.available,
                    fallback=spec.fallback,
                    service_rates=(
                        spec.service_rates.to_proto() if spec.service_rates is not None else None
                    ),
                )
            )
        return response

    async def close(self) -> None:
        """Waits for background bookkeeping (budget settles of aborted requests)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def mesh_request_id(tenant: str, request_id: str) -> str:
    """The id the mesh knows a request by: the client's id within its tenant's namespace, so
    two tenants' ids never collide (tenant names hold no '/')."""
    return f"{tenant}/{request_id}"


def _as_tool_calls(transcript: Transcript, plan: ToolPlan) -> None:
    """A complete answer produced under a tool constraint gets its parsed ToolCalls and, when
    it made one, the TOOL_CALLS finish reason; one cut short (LENGTH, ...) stays as it is: it
    may not parse."""
    finished = transcript.finished
    if finished is None or finished.finish_reason != common_pb2.FINISH_REASON_STOP:
        return
    calls = answer_calls(plan, "".join(transcript.text))
    if calls:
        finished.tool_calls.extend(calls)
        finished.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS


def _service_s(job: Job, output_tokens: int | None = None) -> float | None:
    """The workers' expected time for the job's prompt and `output_tokens` (by default its
    max_tokens); None while they are not measured."""
    rates = job.model.service_rates
    if rates is None:
        return None
    tokens = job.sampling.max_tokens if output_tokens is None else output_tokens
    return rates.service_s(len(job.prompt_ids), tokens)


def _stop_at(arrived: float, time_remaining_s: float | None) -> float | None:
    """When to stop so the partial answer reaches the client before its deadline."""
    if time_remaining_s is None:
        return None
    margin = min(DEADLINE_MARGIN_S, DEADLINE_MARGIN_FRACTION * time_remaining_s)
    return arrived + time_remaining_s - margin


async def _cancel_when_set(cancelled: asyncio.Event, cancel: Callable[[str], None]) -> None:
    await cancelled.wait()
    cancel("cancelled by the client")


def _fingerprint(request: gateway_pb2.GenerateRequest) -> bytes:
    """What must match for a repeated idempotency key: the request without its id."""
    copy = gateway_pb2.GenerateRequest()
    copy.CopyFrom(request)
    copy.request_id = ""
    return hashlib.sha256(copy.SerializeToString(deterministic=True)).digest()


def _span_attributes(job: Job) -> dict[str, str | int | float]:
    return {
        "gen_ai.request.model": job.model.id,
        "gen_ai.request.max_tokens": job.sampling.max_tokens,
        "gen_ai.request.temperature": job.sampling.temperature,
        "gen_ai.usage.input_tokens": len(job.prompt_ids),
        "kvmesh.tenant": job.tenant.name,
        "kvmesh.priority": job.priority.name.lower(),
        "kvmesh.request_id": job.request_id,
    }


def _end_span(span: trace.Span, transcript: Transcript) -> None:
    span.set_attribute("gen_ai.response.model", transcript.model)
    span.set_attribute("gen_ai.usage.output_tokens", len(transcript.token_ids))
    if transcript.finished is not None:
        reason = common_pb2.FinishReason.Name(transcript.finished.finish_reason)
        span.set_attribute(
            "gen_ai.response.finish_reasons", [reason.removeprefix("FINISH_REASON_").lower()]
        )
    span.end()


def log_finished_request(
    tenant: str,
    transcript: Transcript,
    counts: TokenCounts,
    finished: common_pb2.Finished,
    reason: str,
) -> None:
    """The request's one line: who, which model, how many tokens, how fast, how it ended."""
    if not request_log.isEnabledFor(logging.INFO):
        return
    ttft = f"{finished.timings.ttft_ms:.1f}" if finished.timings.HasField("ttft_ms") else "-"
    request_log.info(
        "request %s tenant=%s model=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d "
        "ttft_ms=%s e2e_ms=%.1f finish=%s%s",
        transcript.request_id,
        tenant,
        transcript.model,
        counts.prompt_tokens,
        counts.cached_prompt_tokens,
        counts.completion_tokens,
        ttft,
        finished.timings.e2e_ms,
        reason,
        " response_cache_hit" if transcript.response_cache_hit else "",
    )
