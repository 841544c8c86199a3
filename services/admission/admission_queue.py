"""Admission control: a bounded priority queue in front of the router.

At most the concurrency limit's requests run toward the router at once (limiter.py: fixed at
`max_in_flight`, or adaptive between a floor and it), and while interactive requests are about
(running, waiting, or granted a slot within the last hold period) batch requests may hold at
most their share of those slots (`batch_max_in_flight / max_in_flight`), so an interactive
request always finds a slot soon; with none about, batch work may take every slot rather
than leave part of the workers' batch empty. A freed slot goes to the oldest interactive
waiter first, then to the oldest batch waiter: batch work yields to interactive work. A
request that finds no free slot is shed at once (ResourceExhausted with a retry-after) when
its class's queue is full or when the expected wait plus its expected service time would
outlast its deadline (shedding.py; the wait widened by how far recent waits ran over their
estimates, calibration.py); a waiter whose slot comes too late to finish in time is not
started but ends with DeadlineExceeded. A request that finds a free slot takes it: it
holds up nobody.

The expected wait counts the slots that free up (the limit's worth per average hold) and who
takes them: an interactive request waits for the interactive ones ahead of it; a batch
request also waits while interactive requests keep arriving, since each freed slot goes to
them first, so its wait counts only the slots that interactive requests left over during the
last hold period (at least one: what decides a batch request's fate is how long interactive
work has been taking every slot, and that stretch may end).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.errors import DeadlineExceeded, ResourceExhausted
from kvmesh.tenants import PriorityClass
from services.admission import metrics
from services.admission.calibration import ServiceCalibration, WaitCalibration
from services.admission.limiter import ConcurrencyLimit, FixedLimit
from services.admission.shedding import MIN_RETRY_S, judge

_SMOOTHING = 0.2
"""Weight of the newest sample in the moving average of slot hold times."""


@dataclass(slots=True, frozen=True)
class QueueLimits:
    """Bounds of the admission queue."""

    max_in_flight: int
    batch_max_in_flight: int
    interactive_queue: int
    batch_queue: int

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if not 1 <= self.batch_max_in_flight <= self.max_in_flight:
            raise ValueError("batch_max_in_flight must be between 1 and max_in_flight")
        if self.interactive_queue < 0 or self.batch_queue < 0:
            raise ValueError("queue sizes must not be negative")

    def queue_size(self, priority: PriorityClass) -> int:
        return self.interactive_queue if priority is PriorityClass.INTERACTIVE else self.batch_queue


@dataclass(slots=True)
class Ticket:
    """An admitted request's slot; give it back with `AdmissionQueue.release`."""

    priority: PriorityClass
    admitted_at: float
    queued_s: float
    released: bool = field(default=False)
    measured: bool = False
    """Set before release when the request's end says how fast the workers served it (a
    whole answer or a missed deadline; a cancel says nothing): the limit learns from it."""
    output_tokens: int = 0
    """Tokens the request produced, set with `measured`."""
    requested_tokens: int = 0
    """Tokens the request asked for (its max_tokens), set with `measured`."""
    missed_deadline: bool = False
    """Set with `measured`: the request ran into its deadline."""
    expected_in_time: bool = False
    """The admission expected the request to finish before its deadline (its expected
    service time fitted the time it had left when it got its slot)."""
    expected_s: float | None = None
    """Set with `measured`: the service time the workers' rates expect for the request's
    prompt and the tokens it produced (None: no rates); calibrates later estimates."""


@dataclass(slots=True, eq=False)
class _Waiter:
    """A request queued for a slot."""

    future: asyncio.Future[None]
    deadline: float | None
    service_s: float | None
    arrived: float
    expected_wait_s: float
    """The wait it was admitted on (the margin left out: what the margin is learned from)."""


class AdmissionQueue:
    """Hands out in-flight slots by priority; see the module docstring for the rules."""

    def __init__(
        self,
        limits: QueueLimits,
        limiter: ConcurrencyLimit | None = None,
        *,
        service_aware: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`service_aware`: the expected service time a request comes with, scaled by how
        long finished requests took against theirs (calibration.py), counts toward shedding
        it (else only the wait does, as with `--admission fixed`)."""
        self.limits = limits
        self.limiter = limiter if limiter is not None else FixedLimit(limits.max_in_flight)
        self.service_aware = service_aware
        self.calibration = ServiceCalibration()
        self.wait_calibration = {p: WaitCalibration() for p in PriorityClass}
        """Per class: a batch request waits out the interactive ones that keep overtaking
        it, so its waits run over by more than an interactive request's, whose wait the
        batch's margin would make look longer than it is."""
        self._clock = clock
        self._running = dict.fromkeys(PriorityClass, 0)
        self._waiting: dict[PriorityClass, deque[_Waiter]] = {p: deque() for p in PriorityClass}
        self._hold_s: float | None = None
        """Moving average of how long a request holds its slot; None before the first one."""
        self._interactive_grants: deque[float] = deque()
        """When interactive requests got their slots, over about the last hold period."""

    def running(self, priority: PriorityClass | None = None) -> int:
        if priority is None:
            return sum(self._running.values())
        return self._running[priority]

    def waiting(self, priority: PriorityClass) -> int:
        return len(self._waiting[priority])

    def slots(self, priority: PriorityClass) -> int:
        """Slots a request of `priority` may have now: batch its share of the limit while
        interactive requests are about, else the whole limit."""
        limit = min(self.limiter.limit, self.limits.max_in_flight)
        if priority is PriorityClass.INTERACTIVE or not self._interactive_about():
            return limit
        share = self.limits.batch_max_in_flight / self.limits.max_in_flight
        return max(1, math.floor(limit * share))

    def expected_wait_s(self, priority: PriorityClass) -> float:
        """How long a request of `priority` queued now would wait (0 while unknown); see
        the module docstring."""
        if self._hold_s is None:
            return 0.0
        # A hold period frees about `slots` slots; the interactive waiters take the first.
        slots = self.slots(PriorityClass.INTERACTIVE)
        interactive_s = self.waiting(PriorityClass.INTERACTIVE) * self._hold_s / slots
        if priority is PriorityClass.INTERACTIVE:
            return interactive_s + self._hold_s / slots
        left_over = slots - self._recent_interactive_grants()
        batch_slots = max(1, min(left_over, self.slots(PriorityClass.BATCH)))
        return interactive_s + (self.waiting(PriorityClass.BATCH) + 1) * self._hold_s / batch_slots

    async def admit(
        self,
        priority: PriorityClass,
        deadline: float | None = None,
        service_s: float | None = None,
    ) -> Ticket:
        """Waits for a slot; `deadline` is on this queue's clock (time.monotonic by default),
        `service_s` the time the workers are expected to take (None: unknown)."""
        arrived = self._clock()
        service_s = self.calibration.scaled(service_s) if self.service_aware else None
        if self._may_start(priority) and not self._anyone_ahead(priority):
            # A free slot: it costs no other request anything, so even a request that
            # cannot finish in time runs, and gets what its deadline allows (DEADLINE).
            self._count_running(priority, +1)
            fits = _fits(arrived, deadline, service_s)
            return Ticket(priority, admitted_at=arrived, queued_s=0.0, expected_in_time=fits)
        wait_s = self._shed_if_hopeless(priority, arrived, deadline, service_s)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), deadline, service_s, arrived, wait_s)
        self._waiting[priority].append(waiter)
        self._publish(priority)
        try:
            async with asyncio.timeout_at(_loop_time(deadline, self._clock)):
                await asyncio.shield(waiter.future)
        except BaseException as error:
            self._abandon(priority, waiter)
            if isinstance(error, TimeoutError | DeadlineExceeded):
                waited = self._clock() - arrived
                if waiter.future.cancelled():  # it timed out unserved (else _dispatch learnt)
                    self._learn_wait(priority, waiter, waited)
                metrics.REQUESTS_SHED.labels(priority.name.lower(), "deadline").inc()
                raise DeadlineExceeded(
                    f"the deadline passed after {waited:.3f}s in the admission queue"
                    if isinstance(error, TimeoutError)
                    else f"{error} after {waited:.3f}s in the admission queue"
                ) from None
            raise
        finally:
            self._publish(priority)
        now = self._clock()
        fits = _fits(now, deadline, service_s)
        return Ticket(priority, admitted_at=now, queued_s=now - arrived, expected_in_time=fits)

    def release(self, ticket: Ticket) -> None:
        """Returns the slot and hands it to the next waiter (idempotent); a ticket that
        produced tokens teaches the concurrency limit its latency."""
        if ticket.released:
            return
        ticket.released = True
        in_flight = self.running()
        self._count_running(ticket.priority, -1)
        held = self._clock() - ticket.admitted_at
        self._hold_s = (
            held if self._hold_s is None else ((1 - _SMOOTHING) * self._hold_s + _SMOOTHING * held)
        )
        if ticket.measured:
            if ticket.expected_s is not None:
                self.calibration.observe(held, ticket.expected_s)
                metrics.SERVICE_CALIBRATION.set(self.calibration.factor)
            late = ticket.missed_deadline and ticket.expected_in_time
            self.limiter.observe(
                held / max(ticket.output_tokens, 1),
                in_flight,
                late and _late_unqueued(ticket, held),
            )
        metrics.CONCURRENCY_LIMIT.set(self.limiter.limit)
        self._dispatch()

    def _may_start(self, priority: PriorityClass) -> bool:
        if self.running() >= self.slots(PriorityClass.INTERACTIVE):
            return False
        return priority is PriorityClass.INTERACTIVE or (
            self._running[PriorityClass.BATCH] < self.slots(PriorityClass.BATCH)
        )

    def _anyone_ahead(self, priority: PriorityClass) -> bool:
        if self._waiting[PriorityClass.INTERACTIVE]:
            return True
        return priority is PriorityClass.BATCH and bool(self._waiting[PriorityClass.BATCH])

    def _count_running(self, priority: PriorityClass, change: int) -> None:
        """Takes (+1) or frees (-1) a slot: the one place the count changes, so its gauge
        shows it on every path (a slot granted to a waiter cancelled before it ran included)."""
        self._running[priority] += change
        if change > 0 and priority is PriorityClass.INTERACTIVE:
            self._interactive_grants.append(self._clock())
            self._forget_old_interactive_grants()
        metrics.REQUESTS_RUNNING.labels(priority.name.lower()).set(self._running[priority])

    def _interactive_about(self) -> bool:
        """Interactive requests run, wait, or got a slot within the last hold period: the
        share of the slots kept from batch work is theirs to find."""
        return (
            self._running[PriorityClass.INTERACTIVE] > 0
            or bool(self._waiting[PriorityClass.INTERACTIVE])
            or self._recent_interactive_grants() > 0
        )

    def _recent_interactive_grants(self) -> int:
        """Slots interactive requests took during the last hold period (all of them while
        no hold was measured: nothing is dropped before the period is known)."""
        self._forget_old_interactive_grants()
        return len(self._interactive_grants)

    def _forget_old_interactive_grants(self) -> None:
        """Keeps the record of interactive grants one hold period long."""
        grants = self._interactive_grants
        if self._hold_s is not None:
            since = self._clock() - self._hold_s
            while grants and grants[0] < since:
                grants.popleft()

    def _shed_if_hopeless(
        self,
        priority: PriorityClass,
        now: float,
        deadline: float | None,
        service_s: float | None,
    ) -> float:
        """Refuses a request that cannot finish in time if it queues; else returns the wait
        expected for it."""
        label = priority.name.lower()
        wait = self.expected_wait_s(priority)
        if self.waiting(priority) >= self.limits.queue_size(priority):
            metrics.REQUESTS_SHED.labels(label, "queue_full").inc()
            raise ResourceExhausted(
                f"the {label} queue is full ({self.limits.queue_size(priority)} waiting); "
                "retry later",
                retry_after_s=max(wait, MIN_RETRY_S),
            )
        margin = self.wait_calibration[priority].margin_s if self.service_aware else 0.0
        refusal = judge(None if deadline is None else deadline - now, wait + margin, service_s)
        if refusal is not None:
            metrics.REQUESTS_SHED.labels(label, refusal.reason).inc()
            raise ResourceExhausted(
                f"{label}: {refusal.message}", retry_after_s=refusal.retry_after_s
            )
        return wait

    def _dispatch(self) -> None:
        """Grants free slots: interactive waiters first, then batch within its share; a
        waiter that could no longer finish in time is told so instead."""
        now = self._clock()
        for priority in PriorityClass:
            queue = self._waiting[priority]
            while queue and self._may_start(priority):
                waiter = queue.popleft()
                if waiter.future.done():
                    continue
                self._learn_wait(priority, waiter, now - waiter.arrived)
                if _too_late(waiter, now):
                    waiter.future.set_exception(
                        DeadlineExceeded("its slot came too late to finish before the deadline")
                    )
                    continue
                self._count_running(priority, +1)
                waiter.future.set_result(None)
            self._publish(priority)

    def _learn_wait(self, priority: PriorityClass, waiter: _Waiter, waited_s: float) -> None:
        """A waiter got its slot, or left the queue unserved when its deadline came: how far
        its wait ran over the estimate it was admitted on."""
        calibration = self.wait_calibration[priority]
        calibration.observe(waited_s, waiter.expected_wait_s)
        metrics.WAIT_MARGIN.labels(priority.name.lower()).set(calibration.margin_s)

    def _abandon(self, priority: PriorityClass, waiter: _Waiter) -> None:
        """A waiter gave up (deadline or cancel): drop it, or return a slot it already got."""
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            self._count_running(priority, -1)
            self._dispatch()
            return
        future.cancel()
        with contextlib.suppress(ValueError):  # already popped by _dispatch
            self._waiting[priority].remove(waiter)

    def _publish(self, priority: PriorityClass) -> None:
        metrics.REQUESTS_WAITING.labels(priority.name.lower()).set(self.waiting(priority))


def _fits(now: float, deadline: float | None, service_s: float | None) -> bool:
    """Started now, a request of `service_s` is expected to finish before `deadline`."""
    return deadline is not None and service_s is not None and now + service_s <= deadline


def _late_unqueued(ticket: Ticket, held_s: float) -> bool:
    """Whether a request that ran into its deadline would have missed it even without its
    wait in the queue: at the pace it produced tokens while it held its slot, all it asked
    for takes longer than its whole time, wait included (no token at all: it would). Only
    then is the workers' batch too slow for the deadline; a request late for having waited
    says the queue was too long, which shedding answers, not a smaller batch (whose lower
    throughput would make every wait longer)."""
    if ticket.output_tokens == 0:
        return True
    service_s = held_s * max(ticket.requested_tokens, ticket.output_tokens) / ticket.output_tokens
    return service_s >= ticket.queued_s + held_s


def _too_late(waiter: _Waiter, now: float) -> bool:
    """Started now, the waiter would not finish before its deadline."""
    if waiter.deadline is None or waiter.service_s is None:
        return False
    return now + waiter.service_s > waiter.deadline


def _loop_time(deadline: float | None, clock: Callable[[], float]) -> float | None:
    """Converts a deadline on `clock` to the event loop's clock."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + (deadline - clock())
