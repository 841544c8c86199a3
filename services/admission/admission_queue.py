"""Admission control: a bounded priority queue in front of the router.

At most `max_in_flight` requests run toward the router at once, and batch requests may hold
at most `batch_max_in_flight` of those slots, so an interactive request always finds a slot
soon. A freed slot goes to the oldest interactive waiter first, then to the oldest batch
waiter. A request is shed at once (ResourceExhausted with a retry-after) when its class's
queue is full or when the expected wait would outlast its deadline, instead of waiting for a
deadline it cannot meet.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.errors import DeadlineExceeded, ResourceExhausted
from kvmesh.tenants import PriorityClass
from services.admission import metrics

_SMOOTHING = 0.2
"""Weight of the newest sample in the moving average of slot hold times."""

_MIN_RETRY_S = 0.05


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

    def slots(self, priority: PriorityClass) -> int:
        return (
            self.max_in_flight
            if priority is PriorityClass.INTERACTIVE
            else (self.batch_max_in_flight)
        )


@dataclass(slots=True)
class Ticket:
    """An admitted request's slot; give it back with `AdmissionQueue.release`."""

    priority: PriorityClass
    admitted_at: float
    queued_s: float
    released: bool = field(default=False)


class AdmissionQueue:
    """Hands out in-flight slots by priority; see the module docstring for the rules."""

    def __init__(self, limits: QueueLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._running = dict.fromkeys(PriorityClass, 0)
        self._waiting: dict[PriorityClass, deque[asyncio.Future[None]]] = {
            p: deque() for p in PriorityClass
        }
        self._hold_s: float | None = None
        """Moving average of how long a request holds its slot; None before the first one."""

    def running(self, priority: PriorityClass | None = None) -> int:
        if priority is None:
            return sum(self._running.values())
        return self._running[priority]

    def waiting(self, priority: PriorityClass) -> int:
        return len(self._waiting[priority])

    def expected_wait_s(self, priority: PriorityClass) -> float:
        """How long a request of `priority` queued now would wait (0 while unknown)."""
        if self._hold_s is None:
            return 0.0
        ahead = self.waiting(PriorityClass.INTERACTIVE)
        if priority is PriorityClass.BATCH:
            ahead += self.waiting(PriorityClass.BATCH)
        # Slots free up at about slots / hold_s per second; we need ahead + 1 of them.
        return (ahead + 1) * self._hold_s / self.limits.slots(priority)

    async def admit(self, priority: PriorityClass, deadline: float | None = None) -> Ticket:
        """Waits for a slot; `deadline` is on this queue's clock (time.monotonic by default)."""
        arrived = self._clock()
        if self._may_start(priority) and not self._anyone_ahead(priority):
            self._take_slot(priority)
            return Ticket(priority, admitted_at=arrived, queued_s=0.0)
        self._shed_if_hopeless(priority, arrived, deadline)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiting[priority]
        queue.append(future)
        self._publish(priority)
        try:
            async with asyncio.timeout_at(_loop_time(deadline, self._clock)):
                await asyncio.shield(future)
        except BaseException as error:
            self._abandon(priority, future)
            if isinstance(error, TimeoutError):
                waited = self._clock() - arrived
                metrics.REQUESTS_SHED.labels(priority.name.lower(), "deadline").inc()
                raise DeadlineExceeded(
                    f"the deadline passed after {waited:.3f}s in the admission queue"
                ) from None
            raise
        finally:
            self._publish(priority)
        now = self._clock()
        return Ticket(priority, admitted_at=now, queued_s=now - arrived)

    def release(self, ticket: Ticket) -> None:
        """Returns the slot and hands it to the next waiter (idempotent)."""
        if ticket.released:
            return
        ticket.released = True
        self._running[ticket.priority] -= 1
        held = self._clock() - ticket.admitted_at
        self._hold_s = (
            held if self._hold_s is None else ((1 - _SMOOTHING) * self._hold_s + _SMOOTHING * held)
        )
        metrics.REQUESTS_RUNNING.labels(ticket.priority.name.lower()).set(
            self._running[ticket.priority]
        )
        self._dispatch()

    def _may_start(self, priority: PriorityClass) -> bool:
        if self.running() >= self.limits.max_in_flight:
            return False
        return priority is PriorityClass.INTERACTIVE or (
            self._running[PriorityClass.BATCH] < self.limits.batch_max_in_flight
        )

    def _anyone_ahead(self, priority: PriorityClass) -> bool:
        if self._waiting[PriorityClass.INTERACTIVE]:
            return True
        return priority is PriorityClass.BATCH and bool(self._waiting[PriorityClass.BATCH])

    def _take_slot(self, priority: PriorityClass) -> None:
        self._running[priority] += 1
        metrics.REQUESTS_RUNNING.labels(priority.name.lower()).set(self._running[priority])

    def _shed_if_hopeless(
        self, priority: PriorityClass, now: float, deadline: float | None
    ) -> None:
        label = priority.name.lower()
        expected = self.expected_wait_s(priority)
        retry_after = max(expected, _MIN_RETRY_S)
        if self.waiting(priority) >= self.limits.queue_size(priority):
            metrics.REQUESTS_SHED.labels(label, "queue_full").inc()
            raise ResourceExhausted(
                f"the {label} queue is full ({self.limits.queue_size(priority)} waiting); "
                "retry later",
                retry_after_s=retry_after,
            )
        if deadline is not None and now + expected > deadline:
            metrics.REQUESTS_SHED.labels(label, "deadline").inc()
            raise ResourceExhausted(
                f"expected wait in the {label} queue ({expected:.3f}s) exceeds the "
                f"request's deadline ({max(deadline - now, 0.0):.3f}s left)",
                retry_after_s=retry_after,
            )

    def _dispatch(self) -> None:
        """Grants free slots: interactive waiters first, then batch within its share."""
        for priority in PriorityClass:
            queue = self._waiting[priority]
            while queue and self._may_start(priority):
                future = queue.popleft()
                if future.done():
                    continue
                self._take_slot(priority)
                future.set_result(None)
            self._publish(priority)

    def _abandon(self, priority: PriorityClass, future: asyncio.Future[None]) -> None:
        """A waiter gave up (deadline or cancel): drop it, or return a slot it already got."""
        if future.done() and not future.cancelled():
            self._running[priority] -= 1
            self._dispatch()
            return
        future.cancel()
        with contextlib.suppress(ValueError):  # already popped by _dispatch
            self._waiting[priority].remove(future)

    def _publish(self, priority: PriorityClass) -> None:
        metrics.REQUESTS_WAITING.labels(priority.name.lower()).set(self.waiting(priority))


def _loop_time(deadline: float | None, clock: Callable[[], float]) -> float | None:
    """Converts a deadline on `clock` to the event loop's clock."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + (deadline - clock())
