"""The adaptive concurrency limit, fed synthetic latencies from a modelled worker."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from services.admission.limiter import FixedLimit, VegasLimit, VegasSettings


def batching_worker(knee: int, step_s: float = 0.03) -> Callable[[int], float]:
    """Latency per output token of a worker running `n` requests: one step serves the whole
    batch up to `knee` sequences (a little slower as it grows), beyond that the rest queue."""

    def latency(n: int) -> float:
        served = min(n, knee)
        step = step_s * (1 + 0.02 * served)
        return step * max(1.0, n / knee)

    return latency


def settle(limiter: VegasLimit, latency_of: Callable[[int], float], rounds: int = 400) -> list[int]:
    """Drives the limiter with the latency of a worker kept full at its limit."""
    seen = []
    for _ in range(rounds):
        in_flight = limiter.limit
        limiter.observe(latency_of(in_flight), in_flight, dropped=False)
        seen.append(limiter.limit)
    return seen


def test_the_limit_grows_from_its_start_to_where_requests_queue() -> None:
    limiter = VegasLimit(VegasSettings(initial=2, max_limit=200, probe_every=10_000))
    seen = settle(limiter, batching_worker(knee=24))
    final = seen[-50:]
    # Grown well into the workers' batch (the step time growing with it reads as some
    # queueing), and never queueing far past it.
    assert min(final) >= 12, final
    assert max(final) <= 36, final


def test_the_limit_follows_the_workers_when_they_slow_down() -> None:
    limiter = VegasLimit(VegasSettings(initial=2, max_limit=200, probe_every=10_000))
    settle(limiter, batching_worker(knee=24))
    before = limiter.limit
    # Two thirds of the workers gone: the same load now queues past 8.
    settle(limiter, batching_worker(knee=8))
    assert limiter.limit < before
    assert limiter.limit <= 2 * 8


def test_missed_deadlines_shrink_the_limit() -> None:
    limiter = VegasLimit(VegasSettings(initial=32, max_limit=64, probe_every=10_000))
    limiter.observe(0.03, 32, dropped=False)  # the no-load figure
    for _ in range(10):
        limiter.observe(0.03, 32, dropped=True)
    # Each drop takes log10(limit) (at least 1) off.
    assert limiter.limit <= 32 - 10


def test_a_lightly_loaded_gateway_learns_nothing_about_its_limit() -> None:
    limiter = VegasLimit(VegasSettings(initial=16, max_limit=64, probe_every=10_000))
    limiter.observe(0.03, 2, dropped=False)
    for _ in range(50):
        limiter.observe(0.09, 2, dropped=False)  # slow, but only 2 of 16 in flight
    assert limiter.limit == 16


def test_the_limit_stays_within_its_bounds() -> None:
    grow = VegasLimit(VegasSettings(initial=4, min_limit=2, max_limit=10, probe_every=10_000))
    settle(grow, lambda n: 0.03)  # never any queueing
    assert grow.limit == 10
    shrink = VegasLimit(VegasSettings(initial=4, min_limit=2, max_limit=10, probe_every=10_000))
    shrink.observe(0.01, 4, dropped=False)
    for _ in range(100):
        shrink.observe(1.0, shrink.limit, dropped=True)
    assert shrink.limit == 2


def test_the_no_load_latency_is_measured_again_after_a_probe() -> None:
    limiter = VegasLimit(VegasSettings(initial=4, max_limit=64, probe_every=2))
    limiter.observe(0.001, 4, dropped=False)  # a figure from a quieter time
    assert limiter.no_load_s == 0.001
    for _ in range(3 * 2 * 64):
        limiter.observe(0.05, limiter.limit, dropped=False)
    assert limiter.no_load_s == pytest.approx(0.05)


def test_fixed_limit_ignores_latency() -> None:
    fixed = FixedLimit(12)
    fixed.observe(100.0, 12, dropped=True)
    assert fixed.limit == 12


@pytest.mark.parametrize(
    "settings",
    [
        dict(initial=0),
        dict(initial=10, max_limit=5),
        dict(alpha=6.0, beta=3.0),
        dict(smoothing=0.0),
    ],
)
def test_bad_settings_are_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        VegasSettings(**settings)  # type: ignore[arg-type]


def test_smoothing_takes_part_of_each_step() -> None:
    full = VegasLimit(VegasSettings(initial=10, max_limit=100, probe_every=10_000))
    half = VegasLimit(VegasSettings(initial=10, max_limit=100, smoothing=0.5, probe_every=10_000))
    for limiter in (full, half):
        limiter.observe(0.03, 10, dropped=False)
        limiter.observe(0.03, 10, dropped=False)  # nothing queued: a big step up
    assert full.estimate - 10 == pytest.approx(2 * (half.estimate - 10))
    assert full.estimate == pytest.approx(10 + 6 * max(1.0, math.log10(10)))
