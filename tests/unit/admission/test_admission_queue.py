"""Admission queue: priority order, per-class bounds, batch share, shedding, deadlines."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from kvmesh.errors import DeadlineExceeded, ResourceExhausted
from kvmesh.tenants import PriorityClass
from services.admission.admission_queue import AdmissionQueue, QueueLimits, Ticket
from services.admission.limiter import ConcurrencyLimit, FixedLimit

INTERACTIVE = PriorityClass.INTERACTIVE
BATCH = PriorityClass.BATCH


def queue(max_in_flight: int = 1, batch_max: int = 1, iq: int = 8, bq: int = 8) -> AdmissionQueue:
    return AdmissionQueue(QueueLimits(max_in_flight, batch_max, iq, bq))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def running_gauge(priority: PriorityClass) -> float | None:
    """The gateway's kvmesh:admission_requests_running gauge for `priority`."""
    return REGISTRY.get_sample_value(
        "kvmesh:admission_requests_running", {"priority": priority.name.lower()}
    )


async def test_free_slots_admit_at_once() -> None:
    q = queue(max_in_flight=2, batch_max=2)
    first = await q.admit(BATCH)
    second = await q.admit(INTERACTIVE)
    assert first.queued_s == 0 and second.queued_s == 0
    assert q.running() == 2


async def test_a_freed_slot_goes_to_interactive_before_older_batch() -> None:
    q = queue()
    running = await q.admit(BATCH)
    order: list[str] = []

    async def wait(priority: PriorityClass, name: str) -> Ticket:
        ticket = await q.admit(priority)
        order.append(name)
        return ticket

    batch = asyncio.create_task(wait(BATCH, "batch"))
    await settle()
    interactive = asyncio.create_task(wait(INTERACTIVE, "interactive"))
    await settle()
    assert q.waiting(BATCH) == 1 and q.waiting(INTERACTIVE) == 1
    q.release(running)
    q.release(await interactive)
    await batch
    assert order == ["interactive", "batch"]


async def test_batch_share_keeps_slots_for_interactive() -> None:
    q = queue(max_in_flight=4, batch_max=2)
    await q.admit(INTERACTIVE)  # interactive work about: batch keeps to its 2 of 4
    await q.admit(BATCH)
    await q.admit(BATCH)
    third_batch = asyncio.create_task(q.admit(BATCH))
    await settle()
    assert not third_batch.done()
    interactive = await asyncio.wait_for(q.admit(INTERACTIVE), 1.0)
    assert interactive.queued_s == 0
    third_batch.cancel()


async def test_with_no_interactive_request_about_batch_takes_every_slot() -> None:
    clock = ManualClock()
    q = aware_queue(FixedLimit(4), clock, batch_max=2)  # batch's share: 2 of 4
    assert q.slots(BATCH) == 4
    batch = [await q.admit(BATCH) for _ in range(4)]
    interactive = asyncio.create_task(q.admit(INTERACTIVE))
    fifth_batch = asyncio.create_task(q.admit(BATCH))
    await settle()
    assert not interactive.done()  # every slot taken: it is first in line
    assert q.slots(BATCH) == 2  # and from now batch keeps to its share
    clock.now += 1.0
    q.release(batch.pop())
    assert (await asyncio.wait_for(interactive, 1.0)).queued_s == pytest.approx(1.0)
    q.release(batch.pop())
    await settle()
    assert not fifth_batch.done()  # a free slot, but batch holds its share (2) already
    assert q.running(BATCH) == 2 and q.running(INTERACTIVE) == 1
    fifth_batch.cancel()


async def test_a_full_class_queue_sheds_with_retry_after() -> None:
    q = queue(bq=1)
    ticket = await q.admit(BATCH)
    waiting = asyncio.create_task(q.admit(BATCH))
    await settle()
    with pytest.raises(ResourceExhausted) as raised:
        await q.admit(BATCH)
    assert raised.value.retry_after_s is not None and raised.value.retry_after_s > 0
    assert "batch queue is full" in str(raised.value)
    # The interactive queue is separate.
    interactive = asyncio.create_task(q.admit(INTERACTIVE))
    await settle()
    q.release(ticket)
    q.release(await interactive)
    q.release(await waiting)


async def test_expected_wait_beyond_the_deadline_sheds_at_once() -> None:
    q = queue()
    ticket = await q.admit(INTERACTIVE)
    await asyncio.sleep(0.05)
    q.release(ticket)  # teaches the queue that a request holds its slot ~50 ms
    await q.admit(INTERACTIVE)
    started = time.monotonic()
    with pytest.raises(ResourceExhausted) as raised:
        await q.admit(INTERACTIVE, deadline=time.monotonic() + 0.01)
    assert time.monotonic() - started < 0.01
    assert "exceeds the request's deadline" in str(raised.value)
    assert raised.value.retry_after_s == pytest.approx(0.05, rel=0.5)


async def test_a_waiter_whose_deadline_passes_gives_up_cleanly() -> None:
    q = queue()
    ticket = await q.admit(INTERACTIVE)
    with pytest.raises(DeadlineExceeded):
        await q.admit(INTERACTIVE, deadline=time.monotonic() + 0.05)
    assert q.waiting(INTERACTIVE) == 0
    # Admitted on a wait of 0 (nothing measured yet), it waited its 50 ms: learnt once.
    (overrun,) = q.wait_calibration[INTERACTIVE]._samples
    assert overrun >= 0.045
    q.release(ticket)
    assert q.running() == 0
    assert (await asyncio.wait_for(q.admit(INTERACTIVE), 1.0)).queued_s == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_never_holds_a_slot() -> None:
    q = queue()
    ticket = await q.admit(INTERACTIVE)
    waiter = asyncio.create_task(q.admit(INTERACTIVE))
    await settle()
    q.release(ticket)  # grants the slot to the waiter...
    waiter.cancel()  # ...which is cancelled before it runs: the slot must come back
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert q.running() == 0
    assert running_gauge(INTERACTIVE) == 0  # and the gauge must say so
    await asyncio.wait_for(q.admit(INTERACTIVE), 1.0)
    assert running_gauge(INTERACTIVE) == 1


async def test_release_is_idempotent() -> None:
    q = queue(max_in_flight=2, batch_max=2)
    ticket = await q.admit(INTERACTIVE)
    q.release(ticket)
    q.release(ticket)
    assert q.running() == 0


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        QueueLimits(0, 0, 1, 1)
    with pytest.raises(ValueError):
        QueueLimits(2, 3, 1, 1)


class ManualClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def aware_queue(
    limiter: ConcurrencyLimit, clock: ManualClock, batch_max: int = 3
) -> AdmissionQueue:
    return AdmissionQueue(QueueLimits(4, batch_max, 8, 8), limiter, service_aware=True, clock=clock)


async def test_expected_service_time_beyond_the_deadline_sheds_at_once() -> None:
    clock = ManualClock()
    q = aware_queue(FixedLimit(1), clock, batch_max=1)
    held = await q.admit(INTERACTIVE)
    # No free slot, and the workers need 8 s for it while it has 5 s: refused now.
    with pytest.raises(ResourceExhausted) as raised:
        await q.admit(INTERACTIVE, deadline=clock.now + 5.0, service_s=8.0)
    assert "expected time for this prompt and max_tokens (8.000s)" in str(raised.value)
    assert raised.value.retry_after_s is not None and raised.value.retry_after_s > 0
    assert q.waiting(INTERACTIVE) == 0
    # One that fits waits for the slot.
    fits = asyncio.create_task(q.admit(INTERACTIVE, deadline=clock.now + 5.0, service_s=4.0))
    await settle()
    assert q.waiting(INTERACTIVE) == 1
    q.release(held)
    q.release(await fits)
    assert q.running() == 0


async def test_a_free_slot_runs_even_a_request_that_cannot_finish() -> None:
    # It holds up nobody, and gets the partial answer its deadline allows.
    q = aware_queue(FixedLimit(4), ManualClock())
    ticket = await q.admit(INTERACTIVE, deadline=1000.0 + 5.0, service_s=8.0)
    assert ticket.queued_s == 0


async def test_the_wait_counts_with_the_service_time() -> None:
    clock = ManualClock()
    q = aware_queue(FixedLimit(1), clock, batch_max=1)
    first = await q.admit(INTERACTIVE)
    clock.now += 2.0
    q.release(first)  # a slot is held 2 s
    held = await q.admit(INTERACTIVE)
    # Next in line waits ~2 s for the one slot: 2 + 2.5 fits in 5 s, 2 + 3.5 does not.
    fits = asyncio.create_task(q.admit(INTERACTIVE, deadline=clock.now + 5.0, service_s=2.5))
    await settle()
    assert q.waiting(INTERACTIVE) == 1
    with pytest.raises(ResourceExhausted) as raised:
        await q.admit(INTERACTIVE, deadline=clock.now + 6.0, service_s=3.5)
    # One ahead of it: it would wait ~4 s, and 4 + 3.5 is 1.5 s over its 6 s.
    assert raised.value.retry_after_s == pytest.approx(4.0 + 3.5 - 6.0)
    q.release(held)
    q.release(await fits)


async def test_a_waiter_whose_slot_comes_too_late_is_not_started() -> None:
    clock = ManualClock()
    q = aware_queue(FixedLimit(1), clock, batch_max=1)
    held = await q.admit(INTERACTIVE)
    waiter = asyncio.create_task(q.admit(INTERACTIVE, deadline=clock.now + 5.0, service_s=3.0))
    await settle()
    clock.now += 2.5  # the slot frees with 2.5 s left: too little for 3 s of work
    q.release(held)
    with pytest.raises(DeadlineExceeded, match="too late"):
        await waiter
    # Queued on a wait of 0 (nothing measured yet), it waited 2.5 s: that overrun is learnt.
    assert list(q.wait_calibration[INTERACTIVE]._samples) == [pytest.approx(2.5)]
    assert q.running() == 0 and q.waiting(INTERACTIVE) == 0
    assert (await q.admit(INTERACTIVE)).queued_s == 0


async def test_without_service_awareness_only_the_wait_sheds() -> None:
    q = AdmissionQueue(QueueLimits(1, 1, 8, 8))
    held = await q.admit(INTERACTIVE)
    waiter = asyncio.create_task(
        q.admit(INTERACTIVE, deadline=time.monotonic() + 5.0, service_s=8.0)
    )
    await settle()
    assert q.waiting(INTERACTIVE) == 1  # queued, not shed
    q.release(held)
    q.release(await waiter)


class StepLimit:
    """A limit the test sets; records what it was taught."""

    def __init__(self, value: int) -> None:
        self.value = value
        self.seen: list[tuple[float, int, bool]] = []

    @property
    def limit(self) -> int:
        return self.value

    def observe(self, latency_s: float, in_flight: int, late: bool = False) -> None:
        self.seen.append((latency_s, in_flight, late))


async def test_slots_follow_the_adaptive_limit_and_batch_keeps_its_share() -> None:
    clock = ManualClock()
    limit = StepLimit(8)
    q = aware_queue(limit, clock, batch_max=3)  # batch: 3/4 of the limit, never above it
    assert q.slots(INTERACTIVE) == 4  # --max-in-flight caps the limit
    assert q.slots(BATCH) == 4  # no interactive request about: the whole limit
    q.release(await q.admit(INTERACTIVE))  # one got a slot within the last hold period (0 s)
    assert q.slots(BATCH) == 3
    limit.value = 2
    assert q.slots(INTERACTIVE) == 2 and q.slots(BATCH) == 1
    batch = await q.admit(BATCH)
    second_batch = asyncio.create_task(q.admit(BATCH))
    await settle()
    assert not second_batch.done()  # batch's share is taken
    interactive = await q.admit(INTERACTIVE)
    assert interactive.queued_s == 0  # interactive still finds a slot
    limit.value = 4
    clock.now += 1.0
    interactive.measured, interactive.output_tokens = True, 10
    q.release(interactive)  # a release hands out the slots the grown limit added
    assert (await asyncio.wait_for(second_batch, 1.0)).queued_s == pytest.approx(1.0)
    # The limit learnt the released request's latency per token and the load it ran under.
    assert limit.seen == [(pytest.approx(0.1), 2, False)]
    q.release(batch)  # not measured (a cancel, a failure): nothing learnt
    assert len(limit.seen) == 1


async def test_a_missed_deadline_without_tokens_teaches_its_whole_hold() -> None:
    clock = ManualClock()
    limit = StepLimit(4)
    q = aware_queue(limit, clock)
    ticket = await q.admit(INTERACTIVE)
    clock.now += 3.0
    ticket.measured = True  # it ran into its deadline before its first token
    q.release(ticket)
    assert limit.seen == [(pytest.approx(3.0), 1, False)]  # no deadline: nothing promised
    cancelled = await q.admit(INTERACTIVE)
    cancelled.output_tokens = 5
    q.release(cancelled)  # a cancel says nothing about the workers' pace
    assert len(limit.seen) == 1


async def test_late_means_a_deadline_missed_that_the_admission_expected_to_meet() -> None:
    clock = ManualClock()
    limit = StepLimit(2)
    q = aware_queue(limit, clock)
    # 2 s of service with 5 s left: expected in time, yet it ran into its deadline.
    promised = await q.admit(INTERACTIVE, deadline=clock.now + 5.0, service_s=2.0)
    # 8 s of service with 5 s left, on a free slot: it was never expected to make it.
    hopeless = await q.admit(INTERACTIVE, deadline=clock.now + 5.0, service_s=8.0)
    assert promised.expected_in_time and not hopeless.expected_in_time
    # Queued behind them, it gets its slot 4 s later with 6 s left: 5 s of service fits.
    queued = asyncio.create_task(q.admit(INTERACTIVE, deadline=clock.now + 10.0, service_s=5.0))
    await settle()
    clock.now += 4.0
    for ticket in (promised, hopeless):
        ticket.measured, ticket.missed_deadline, ticket.output_tokens = True, True, 4
        q.release(ticket)
    assert (await asyncio.wait_for(queued, 1.0)).expected_in_time
    assert limit.seen == [(pytest.approx(1.0), 2, True), (pytest.approx(1.0), 2, False)]


async def test_a_request_late_for_its_wait_in_the_queue_is_no_sign_the_batch_is_too_slow() -> None:
    clock = ManualClock()
    limit = StepLimit(1)
    q = aware_queue(limit, clock)
    holder = await q.admit(INTERACTIVE)
    # 10 s to its deadline and 4 s of service expected: it waits 5 s, then still fits.
    queued = asyncio.create_task(q.admit(INTERACTIVE, deadline=clock.now + 10.0, service_s=4.0))
    await settle()
    clock.now += 5.0
    q.release(holder)  # not measured
    waited = await asyncio.wait_for(queued, 1.0)
    assert waited.expected_in_time and waited.queued_s == pytest.approx(5.0)
    # Cut at its deadline with 30 of its 32 tokens: 5.33 s of service at that pace, which
    # its 10 s would have held without the wait.
    clock.now += 5.0
    waited.measured, waited.missed_deadline = True, True
    waited.output_tokens, waited.requested_tokens = 30, 32
    q.release(waited)
    # On a free slot, cut at its deadline with 8 of 32: 40 s at that pace, late regardless.
    slow = await q.admit(INTERACTIVE, deadline=clock.now + 10.0, service_s=4.0)
    clock.now += 10.0
    slow.measured, slow.missed_deadline, slow.output_tokens, slow.requested_tokens = (
        True,
        True,
        8,
        32,
    )
    q.release(slow)
    assert limit.seen == [(pytest.approx(5.0 / 30), 1, False), (pytest.approx(10.0 / 8), 1, True)]


async def test_expected_service_is_scaled_by_what_finished_requests_took() -> None:
    clock = ManualClock()
    q = aware_queue(FixedLimit(4), clock)
    # Eight requests each held their slot 3 s where the workers' rates expected 2 s.
    for _ in range(q.calibration.min_samples):
        ticket = await q.admit(INTERACTIVE)
        clock.now += 3.0
        ticket.measured, ticket.output_tokens, ticket.expected_s = True, 8, 2.0
        q.release(ticket)
    assert q.calibration.factor == pytest.approx(1.5)
    held = [await q.admit(INTERACTIVE) for _ in range(4)]
    # 3 s expected by the rates is 4.5 s as requests take it: with 5 s left and a wait
    # ahead (each slot held 3 s, one of four freeing every 0.75 s) it does not fit.
    with pytest.raises(ResourceExhausted, match=r"4\.500s"):
        await q.admit(INTERACTIVE, deadline=clock.now + 5.0, service_s=3.0)
    # A promise made on the scaled estimate: 3 s of rates is 4.5 s, over 4 s left.
    for ticket in held:
        q.release(ticket)
    free = await q.admit(INTERACTIVE, deadline=clock.now + 4.0, service_s=3.0)
    assert not free.expected_in_time


async def test_batch_waits_for_the_slots_interactive_requests_leave_over() -> None:
    clock = ManualClock()
    q = aware_queue(FixedLimit(4), clock)  # 4 slots, batch at most 3
    first = await q.admit(INTERACTIVE)
    clock.now += 2.0
    q.release(first)  # a slot is held 2 s: a hold period frees 4
    held = [await q.admit(INTERACTIVE) for _ in range(4)]
    # Interactive requests took 5 slots in the last 2 s: a batch request waits for the one
    # slot a hold period is assumed to leave it, an interactive one for a quarter period.
    assert q.expected_wait_s(INTERACTIVE) == pytest.approx(0.5)
    assert q.expected_wait_s(BATCH) == pytest.approx(2.0)
    with pytest.raises(ResourceExhausted, match=r"expected wait \(2\.000s\)"):
        await q.admit(BATCH, deadline=clock.now + 2.5, service_s=1.0)
    # No interactive grant in the last hold period: batch's share of 3 slots is back.
    clock.now += 3.0
    assert q.expected_wait_s(BATCH) == pytest.approx(2.0 / 3)
    waiter = asyncio.create_task(q.admit(BATCH, deadline=clock.now + 2.5, service_s=1.0))
    await settle()
    assert q.waiting(BATCH) == 1
    q.release(held.pop())
    q.release(await waiter)
    for ticket in held:
        q.release(ticket)
    assert q.running() == 0


async def test_waits_that_ran_over_their_estimate_widen_the_one_shed_by() -> None:
    clock = ManualClock()
    q = aware_queue(FixedLimit(1), clock, batch_max=1)
    holder = await q.admit(INTERACTIVE)
    overruns = []
    for _ in range(q.wait_calibration[INTERACTIVE].min_samples):
        clock.now += 1.0
        expected = q.expected_wait_s(INTERACTIVE)
        waiter = asyncio.create_task(q.admit(INTERACTIVE, deadline=clock.now + 60.0))
        await settle()
        clock.now += 3.0  # a wave: the slot frees 3 s later, whatever the average said
        q.release(holder)
        holder = await waiter
        overruns.append(3.0 - expected)
    # p90 of 8: the top one; the batch class waited for nothing and keeps no margin.
    assert q.wait_calibration[INTERACTIVE].margin_s == pytest.approx(max(overruns))
    assert q.wait_calibration[BATCH].margin_s == 0
    # Expected wait plus service fits its deadline, with less to spare than waits ran over:
    # refused now, with the margin in the wait it was told.
    expected = q.expected_wait_s(INTERACTIVE)
    margin = q.wait_calibration[INTERACTIVE].margin_s
    with pytest.raises(ResourceExhausted) as raised:
        await q.admit(INTERACTIVE, deadline=clock.now + expected + 4.0 + margin / 2, service_s=4.0)
    assert f"expected wait ({expected + margin:.3f}s)" in str(raised.value)
    assert raised.value.retry_after_s == pytest.approx(margin / 2)
    # One with the margin to spare waits.
    waiter = asyncio.create_task(
        q.admit(INTERACTIVE, deadline=clock.now + expected + 4.0 + margin * 1.5, service_s=4.0)
    )
    await settle()
    assert q.waiting(INTERACTIVE) == 1
    q.release(holder)
    q.release(await waiter)
