"""Runs one request on its placement: prefill -> decode hand-off (or colocated), retry, fallback.

Rules (docs/architecture.md, "Failure rules"):
- The first token reaches the caller as soon as a worker has it: colocated, the worker's
  first chunk; split, the Prefill's answer, so the KV hand-off is off the first token's path.
  A failure before it is retried once, on other workers while others are in rotation.
- A split request whose hand-off fails after its first token went out (the decode start or
  the KV pull: anything before the decode worker confirms the import) is resumed within the
  same two attempts: the prompt runs again on other workers of its tier and the new decode
  continues after the token already sent, so nothing streamed is re-run. Started keeps the
  first placement; the router's span records the new one.
- After the hand-off, a failure is not re-run: the caller gets UNAVAILABLE, whose message
  ends with the usage so far ("usage so far: prompt_tokens=.. cached_prompt_tokens=..
  completion_tokens=.."); a deadline that passes mid-stream ends it with finish reason
  DEADLINE and the partial usage instead.
- A tier with no healthy worker falls back down its fallback chain (placement.fallback).
- The caller's deadline bounds every downstream call.
- A caller's Cancel or disconnect cancels the downstream calls; workers treat that as an
  abort and free the request's blocks. A lease whose decode never started is released here
  (and, if that fails, by its TTL on the prefill worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from opentelemetry import trace

from kvmesh.background import Background
from kvmesh.contracts.sampling import AUTO_MODEL
from kvmesh.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    KvmeshError,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kvmesh.streams import Coalescer
from kvmesh.v1 import common_pb2, worker_pb2
from services.router import events as build
from services.router import metrics
from services.router.difficulty import choose_auto_tier
from services.router.monitor import WorkerMonitor
from services.router.placement import Plan, TierChoice, place, resolve_tier
from services.router.policies import POLICIES
from services.router.policies.base import PlacementPolicy
from services.router.pools import PoolRegistry
from services.router.rates import RateBook
from services.router.worker_client import WorkerClient

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 2
"""The first try and one retry."""
RELEASE_WAIT_S = 2.0
"""How long shutdown waits for the background lease releases."""

_NOT_RETRIED = (InvalidArgument, DeadlineExceeded, Cancelled, PermissionDenied, Unauthenticated)


@dataclass(slots=True)
class _Attempt:
    """What one attempt learned on its way, for Started, Finished and the hand-off rules."""

    plan: Plan
    first_token: common_pb2.TokenChunk | None = None
    """Split: the first token the caller has: this attempt's prefill's, or, when the attempt
    resumes a failed hand-off, the earlier attempt's (the new prefill's own is dropped). It
    may be empty: a stop token, or text held back while it may begin a stop string."""
    sampled: common_pb2.TokenChunk | None = None
    """The token that prefill sampled with first_token (its id and logprob): what the decode
    worker continues after."""
    handed_off: bool = False
    """The decode worker confirmed the KV import: it owns the lease, and the request's fate."""
    cached_prompt_tokens: int = 0
    decoding: str | None = None
    """The address of the worker decoding the attempt's tokens, once it sent one: from then
    on a gap of many of its step times means it stalled."""

    @property
    def resumable(self) -> bool:
        """A failure now can be resumed on other workers: the caller has the first token but
        no decode worker continued after it yet, so nothing streamed would be re-run."""
        return self.first_token is not None and not self.handed_off


@dataclass(slots=True)
class _Job:
    """One request across its attempts: what every attempt needs, and where to try next."""

    request: common_pb2.InferenceRequest
    request_id: str
    deadline: float | None
    cancelled: asyncio.Event
    live: set[Coalescer[common_pb2.GenerateEvent]]
    choice: TierChoice
    attempts: int = 0
    avoid: set[str] = field(default_factory=set)
    retry_note: str = ""


@dataclass(slots=True)
class Orchestrator:
    """Places and runs requests over the registry's workers."""

    registry: PoolRegistry
    workers: WorkerClient
    monitor: WorkerMonitor
    load_cost_tokens: int
    lease_ttl_ms: int = 0
    rates: RateBook = field(default_factory=RateBook)
    """What the attempts measure of each worker's speed (ListModels reports it)."""
    stall_steps: float = 50.0
    """A decoding stream quiet for this many of its worker's measured step times ..."""
    stall_floor_s: float = 2.0
    """... and at least this long ..."""
    stall_step_tokens: int = 1024
    """... and at least twice the worker's measured prefill of this many tokens (its longest
    step) has a stalled worker."""
    _background: Background = field(default_factory=Background)
    _policies: dict[str, PlacementPolicy] = field(init=False)
    _request_ids: set[str] = field(default_factory=set)
    """Ids of the requests running: a second one under an id in use is refused."""

    def __post_init__(self) -> None:
        self._policies = {
            tier.name: POLICIES[tier.placement]() for tier in self.registry.config.tiers
        }

    def choose_tier(self, request: common_pb2.InferenceRequest) -> TierChoice:
        """The serving tier: "auto" resolved by the difficulty rule, then the fallback chain."""
        model, why = request.model, ""
        if model == AUTO_MODEL:
            rule = self.registry.config.auto
            if rule is None:
                # Without a rule there is nothing cheaper to route to: the first tier serves.
                first = self.registry.tiers[0].name
                return resolve_tier(self.registry, first, f"auto: no rule configured -> {first}")
            max_tokens = (
                request.sampling.max_tokens if request.sampling.HasField("max_tokens") else None
            )
            decision = choose_auto_tier(
                rule, len(request.prompt_token_ids), max_tokens, request.labels
            )
            model, why = decision.tier, decision.reason
        if not model:
            raise InvalidArgument("model", "must name a model tier or 'auto'")
        return resolve_tier(self.registry, model, why)

    async def run(
        self,
        request: common_pb2.InferenceRequest,
        deadline: float | None,
        cancelled: asyncio.Event,
        live: set[Coalescer[common_pb2.GenerateEvent]],
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        """Started, TokenChunk*, Finished for one request (errors as KvmeshError).

        The attempt in progress is kept in `live`, so that the caller can stop it (closing
        it cancels the downstream calls) even if this generator is never resumed.
        """
        arrived = time.monotonic()
        span = trace.get_current_span()
        if not request.prompt_token_ids:
            raise InvalidArgument("prompt_token_ids", "must not be empty")
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self._request_ids:
            # Refused before anything runs: the one holding the id is left alone.
            raise AlreadyExists(f"request id {request_id!r} is already in use on this router")
        job = _Job(request, request_id, deadline, cancelled, live, self.choose_tier(request))
        self._request_ids.add(request_id)
        try:
            async for event in self._attempts(job, arrived, span):
                yield event
        finally:
            self._request_ids.discard(request_id)

    async def _attempts(
        self, job: _Job, arrived: float, span: trace.Span
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        """Attempts of the job until one streams its answer (or the caller cancels)."""
        request, request_id, cancelled = job.request, job.request_id, job.cancelled
        while True:
            attempt, events = self._start(job, self._next_plan(job))
            try:
                first = await self._next_batch(job, attempt, events)
                if first is None and not cancelled.is_set():
                    raise Unavailable(
                        f"{attempt.plan.prefill.address} ended the stream without output"
                    )
            except KvmeshError as error:
                await events.aclose()
                await self._prepare_retry(job, attempt, error)
                continue
            if first is None:
                await events.aclose()
                yield build.aborted(build.Usage(len(request.prompt_token_ids)), arrived)
                return
            plan = attempt.plan
            build.record_placement(span, plan, job.attempts)
            metrics.PLACEMENTS.labels(
                plan.tier, "colocated" if plan.colocated else "split", str(plan.fallback).lower()
            ).inc()
            yield build.started(request_id, plan, job.attempts)
            async for event in self._forward(job, attempt, first, events, arrived):
                yield event
            return

    def _next_plan(self, job: _Job) -> Plan:
        """Where the job's next attempt runs (counted as made)."""
        job.attempts += 1
        plan = place(
            self.registry,
            self._policies[job.choice.tier],
            job.choice,
            job.request.prompt_token_ids,
            job.request.cache_salt,
            self.load_cost_tokens,
            job.avoid,
        )
        if job.retry_note:
            plan = Plan(
                tier=plan.tier,
                fallback=plan.fallback,
                prefill=plan.prefill,
                decode=plan.decode,
                reason=f"{plan.reason}; {job.retry_note}",
                expected_prefix_hit_tokens=plan.expected_prefix_hit_tokens,
            )
        return plan

    def _start(
        self, job: _Job, plan: Plan, resumed: _Attempt | None = None
    ) -> tuple[_Attempt, Coalescer[common_pb2.GenerateEvent]]:
        """Starts an attempt on `plan` (continuing `resumed`'s first token, if given); its
        events are drained from now on, and kept in live."""
        attempt = _Attempt(plan)
        if resumed is not None:
            attempt.first_token, attempt.sampled = resumed.first_token, resumed.sampled
        downstream = _downstream_request(job.request, plan.tier, job.request_id, job.attempts)
        # Counted from placement, not from when the drain task first runs: requests that arrive
        # together are placed before any drain runs, and would all see the same idle worker.
        self.registry.occupy(plan.workers)
        events = Coalescer(self._attempt_events(attempt, downstream, job.deadline))
        events.when_drained(functools.partial(self.registry.vacate, plan.workers))
        # The caller's cancel, or a worker of the attempt leaving the rotation (a frozen one,
        # stopped, not dead, would otherwise hold its calls until HTTP/2 keepalive gives up on
        # the connection), ends its events (_next_batch says which).
        events.interrupt_when(job.cancelled)
        for worker in plan.workers:
            events.interrupt_when(self.registry.departure(worker.address))
        job.live.add(events)
        return attempt, events

    async def _prepare_retry(self, job: _Job, attempt: _Attempt, error: KvmeshError) -> None:
        """Readies the job for another attempt after `error`, or raises when there is none:
        the last attempt failed, the error is not one a retry can fix, or no worker is left."""
        addresses = [w.address for w in attempt.plan.workers]
        if job.attempts >= MAX_ATTEMPTS or isinstance(error, _NOT_RETRIED):
            raise _attempts_failed(error, job.attempts)
        log.warning(
            "attempt %d of %s on %s failed: %s", job.attempts, job.request_id, addresses, error
        )
        trace.get_current_span().add_event(
            "kvmesh.retry", {"kvmesh.failed_workers": addresses, "kvmesh.error": str(error)}
        )
        metrics.RETRIES.labels(attempt.plan.tier, error.status).inc()
        # Check the failed workers before placing again: a dead one leaves the rotation (and
        # may take its tier down to the fallback) before the retry.
        await self.monitor.check_many(addresses)
        try:
            job.choice = resolve_tier(self.registry, job.choice.requested, job.choice.why)
        except Unavailable as nowhere:
            raise Unavailable(f"{error.message}; no worker left to retry on: {nowhere}") from None
        job.avoid.update(addresses)
        job.retry_note = f"retry after {error.status} on {', '.join(addresses)}"

    async def _resume_hand_off(
        self,
        job: _Job,
        attempt: _Attempt,
        events: Coalescer[common_pb2.GenerateEvent],
        error: KvmeshError,
    ) -> tuple[_Attempt, Coalescer[common_pb2.GenerateEvent]]:
        """A new attempt for a request whose caller has its first token but whose KV hand-off
        failed: the prompt runs again on other workers and the decode continues after the
        token already sent, so the caller sees one uninterrupted stream.

        Started went out with the first placement; the router's span records the new one."""
        await events.aclose()
        await self._prepare_retry(job, attempt, error)
        plan = self._next_plan(job)
        if plan.colocated or plan.tier != attempt.plan.tier:
            # Another tier's (or a colocated worker's) KV does not continue this first token.
            raise Unavailable(
                f"{error.message}; no {attempt.plan.tier} prefill and decode workers left "
                "to resume the hand-off on"
            )
        build.record_placement(trace.get_current_span(), plan, job.attempts)
        return self._start(job, plan, attempt)

    async def _forward(
        self,
        job: _Job,
        attempt: _Attempt,
        first: list[common_pb2.GenerateEvent],
        events: Coalescer[common_pb2.GenerateEvent],
        arrived: float,
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        """Forwards the attempt's events, coalescing chunks; the rules after the first token."""
        usage = build.Usage(len(job.request.prompt_token_ids))
        first_token_at: float | None = None
        batch: list[common_pb2.GenerateEvent] | None = first
        try:
            while batch is not None:
                for event in build.merge_chunks(batch):
                    usage.cached_prompt_tokens = attempt.cached_prompt_tokens
                    if event.WhichOneof("event") == "chunk":
                        if first_token_at is None:
                            first_token_at = time.monotonic()
                            metrics.TIME_TO_FIRST_TOKEN.labels(attempt.plan.tier).observe(
                                first_token_at - arrived
                            )
                        usage.completion_tokens += len(event.chunk.token_ids)
                        yield event
                    elif event.WhichOneof("event") == "finished":
                        yield build.finished(
                            event.finished,
                            attempt.plan,
                            attempt.cached_prompt_tokens,
                            usage,
                            arrived,
                            first_token_at,
                        )
                        return
                try:
                    batch = await self._next_batch(job, attempt, events)
                except KvmeshError as error:
                    if not attempt.resumable:
                        raise
                    attempt, events = await self._resume_hand_off(job, attempt, events, error)
                    batch = []
            if job.cancelled.is_set():
                yield build.aborted(usage, arrived, first_token_at)
                return
            raise Unavailable("the worker ended the stream without a Finished event")
        except DeadlineExceeded:
            yield build.deadline(usage, arrived, first_token_at)
        except KvmeshError as error:
            tier = attempt.plan.tier
            metrics.FAILURES_AFTER_FIRST_TOKEN.labels(tier).inc()
            self._background.spawn(
                self.monitor.check_many([w.address for w in attempt.plan.workers]),
                f"health check of {tier} after a broken stream",
            )
            raise Unavailable(
                f"{tier}: the stream broke after the first token and is not re-run "
                f"({error.status}: {error.message}); {usage.describe()}"
            ) from None
        finally:
            await events.aclose()

    async def _next_batch(
        self,
        job: _Job,
        attempt: _Attempt,
        events: Coalescer[common_pb2.GenerateEvent],
    ) -> list[common_pb2.GenerateEvent] | None:
        """The attempt's next events; None once the caller cancelled. Unavailable when one of
        its workers leaves the rotation meanwhile (a frozen worker, stopped, not dead, would
        otherwise hold its calls until HTTP/2 keepalive gives up on the connection), or when
        its decoding worker sends nothing for many of its measured step times (stalled while
        its health checks pass)."""
        bound = self._progress_bound(attempt)
        stalled = False

        def stall() -> None:
            nonlocal stalled
            stalled = True
            events.interrupt()

        timer = None if bound is None else asyncio.get_running_loop().call_later(bound, stall)
        try:
            batch = await anext(events, None)
        finally:
            if timer is not None:
                timer.cancel()
        if events.interrupted and batch is None and not job.cancelled.is_set():
            if stalled:
                raise Unavailable(
                    f"{attempt.decoding} sent nothing for {bound:.1f}s, "
                    f"over {self.stall_steps:g} of its measured step times and twice its "
                    f"longest step (stalled)"
                )
            gone = [w.address for w in attempt.plan.workers if not w.in_rotation]
            raise Unavailable(f"{', '.join(gone)} left the rotation (stopped answering)")
        return batch

    def _progress_bound(self, attempt: _Attempt) -> float | None:
        """How long the attempt's decoding worker may send nothing (None: not decoding yet,
        or its step time never measured): a worker that stalls without leaving the rotation
        (its health checks still pass) is found within this."""
        if attempt.decoding is None:
            return None
        step_s = self.rates.step_s(attempt.decoding)
        if step_s is None:
            return None
        # A colocated worker's step that computes a full prefill chunk beside the decodes is
        # as long as that prefill (2.3 s for 1,024 tokens on 2 cores of an AMD EPYC Zen 2):
        # its streams are quiet, not stalled, meanwhile.
        longest_step_s = self.rates.prefill_s(attempt.decoding, self.stall_step_tokens) or 0.0
        return max(self.stall_floor_s, self.stall_steps * step_s, 2 * longest_step_s)

    async def _attempt_events(
        self,
        attempt: _Attempt,
        request: common_pb2.InferenceRequest,
        deadline: float | None,
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        """The events of one attempt, straight from the worker(s)."""
        plan = attempt.plan
        if plan.decode is None:
            colocated = self.workers.colocated(plan.prefill.address, request, _time_left(deadline))
            async with contextlib.aclosing(colocated):
                async for event in self._timed(attempt, request, colocated):
                    yield event
        else:
            split = self._split(attempt, request, deadline)
            async with contextlib.aclosing(split):
                async for event in self._timed(attempt, request, split):
                    yield event

    async def _timed(
        self,
        attempt: _Attempt,
        request: common_pb2.InferenceRequest,
        events: AsyncIterator[common_pb2.GenerateEvent],
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        """The attempt's events, measuring its workers on the way (rates.py): a colocated
        worker's first token is its prefill; then every gap between two chunks that the
        decoding worker produced one after the other (split: not the gap from the prefill's
        token to the first decoded one, which holds the KV hand-off)."""
        plan = attempt.plan
        started = last = time.monotonic()
        chunks = 0
        decoded_from = 1 if plan.decode is None or attempt.first_token is not None else 2
        decoder = (plan.decode or plan.prefill).address
        async for event in events:
            if event.WhichOneof("event") == "chunk" and event.chunk.token_ids:
                now = time.monotonic()
                if chunks == 0 and plan.decode is None:
                    uncached = len(request.prompt_token_ids) - attempt.cached_prompt_tokens
                    self.rates.observe_prefill(plan.prefill.address, uncached, now - started)
                elif chunks >= decoded_from:
                    self.rates.observe_gap(decoder, len(event.chunk.token_ids), now - last)
                chunks += 1
                last = now
                if chunks >= decoded_from:
                    attempt.decoding = decoder  # the next gap is a decode step
            yield event

    async def _split(
        self,
        attempt: _Attempt,
        request: common_pb2.InferenceRequest,
        deadline: float | None,
    ) -> AsyncGenerator[common_pb2.GenerateEvent]:
        plan = attempt.plan
        assert plan.decode is not None
        prefill_address, decode_address = plan.prefill.address, plan.decode.address
        prefill = asyncio.ensure_future(
            self.workers.prefill(
                prefill_address,
                worker_pb2.PrefillRequest(
                    request=request, lease_ttl_ms=self.lease_ttl_ms, puller=decode_address
                ),
                _time_left(deadline),
            )
        )
        asked = time.monotonic()
        prefilled = await self._prefilled(prefill, prefill_address)
        attempt.cached_prompt_tokens = prefilled.cached_prompt_tokens
        self.rates.observe_prefill(
            prefill_address,
            len(request.prompt_token_ids) - prefilled.cached_prompt_tokens,
            time.monotonic() - asked,
        )
        try:
            async for event in self._after_prefill(
                attempt, request, prefilled, decode_address, deadline
            ):
                yield event
        finally:
            if prefilled.HasField("lease") and not attempt.handed_off:
                # No decode worker imported the KV (once one has, it releases the lease).
                self._background.spawn(
                    self.workers.release(prefill_address, prefilled.lease.lease_id),
                    f"ReleaseKv on {prefill_address}",
                )

    async def _after_prefill(
        self,
        attempt: _Attempt,
        request: common_pb2.InferenceRequest,
        prefilled: worker_pb2.PrefillResponse,
        decode_address: str,
        deadline: float | None,
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        """The first token (unless the caller has one already), then the decode's stream."""
        if attempt.first_token is None:
            # The caller gets the prefill's token at once: the KV hand-off runs after the
            # first token, not before it.
            attempt.first_token, attempt.sampled = prefilled.first_token, prefilled.sampled
            if prefilled.first_token.token_ids or prefilled.first_token.text:
                yield common_pb2.GenerateEvent(chunk=prefilled.first_token)
            if prefilled.HasField("finished"):
                # The first token ended the request: nothing to decode, no lease.
                yield common_pb2.GenerateEvent(finished=prefilled.finished)
                return
        elif prefilled.HasField("finished"):
            if prefilled.finished.finish_reason == common_pb2.FINISH_REASON_DEADLINE:
                raise DeadlineExceeded("the request's deadline passed as its prompt ran again")
            # Only unseeded sampling can end the prompt's second run at a different token.
            raise Unavailable(
                "the prompt's second run ended at its own first token, "
                "so there is no KV to continue the first one from"
            )
        # Opened once the first token is on its way: opened while the prompt ran, its set-up
        # delayed the Prefill call's by about a millisecond, on the first token's path.
        start = worker_pb2.DecodeRequest(
            request=request,
            lease=prefilled.lease,
            first_token=attempt.first_token,
            sampled=attempt.sampled,
        )
        decode = self.workers.decode(decode_address, start, _time_left(deadline))
        async with contextlib.aclosing(decode):
            async for event in self._handed_off(attempt, decode, decode_address):
                yield event

    async def _prefilled(
        self, prefill: asyncio.Future[worker_pb2.PrefillResponse], address: str
    ) -> worker_pb2.PrefillResponse:
        """The Prefill's answer; a caller gone meanwhile has the lease released once granted."""
        try:
            # Shielded: a Prefill cancelled in flight may still grant a lease whose id then
            # never arrives. If the caller goes away, the prefill (one prompt) completes and
            # its lease is released at once instead of holding blocks until its TTL.
            return await asyncio.shield(prefill)
        except asyncio.CancelledError:
            self._background.spawn(
                self._release_granted(address, prefill),
                f"release of an abandoned Prefill's lease on {address}",
            )
            raise

    async def _handed_off(
        self,
        attempt: _Attempt,
        decode: AsyncIterator[common_pb2.GenerateEvent],
        decode_address: str,
    ) -> AsyncIterator[common_pb2.GenerateEvent]:
        """The decode worker's stream for a granted lease, after the first token.

        The worker's first chunk echoes the first token once it imported the KV: the caller
        has that token already, so it only marks the hand-off done."""
        received = False
        async for event in decode:
            received = True
            if attempt.handed_off or event.WhichOneof("event") != "chunk":
                yield event
            else:
                attempt.handed_off = True
        if not received:
            raise Unavailable(f"Decode on {decode_address} ended without a word")

    async def _release_granted(
        self, address: str, prefill: asyncio.Future[worker_pb2.PrefillResponse]
    ) -> None:
        """Releases the lease of a Prefill whose caller went away, once it is granted."""
        try:
            prefilled = await prefill
        except KvmeshError:
            return  # the prefill failed: nothing is held
        if prefilled.HasField("lease"):
            await self.workers.release(address, prefilled.lease.lease_id)

    async def close(self) -> None:
        """Waits for the background lease releases (at shutdown)."""
        await self._background.wait(RELEASE_WAIT_S)


def _downstream_request(
    request: common_pb2.InferenceRequest, tier: str, request_id: str, attempt: int
) -> common_pb2.InferenceRequest:
    """The request as workers see it: the resolved tier; a retry gets its own id suffix, so a
    worker still cleaning up the first attempt never sees the id twice."""
    downstream = common_pb2.InferenceRequest()
    downstream.CopyFrom(request)
    downstream.model = tier
    downstream.request_id = request_id if attempt == 1 else f"{request_id}~{attempt}"
    return downstream


def _time_left(deadline: float | None) -> float | None:
    """Seconds to the caller's deadline for the next hop; DeadlineExceeded once it passed."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the request's deadline passed before its first token")
    return left


def _attempts_failed(error: KvmeshError, attempts: int) -> KvmeshError:
    if attempts > 1:
        error.message = f"{error.message} (after {attempts} attempts)"
    return error
