"""The adaptive concurrency limit: exact limits after given windows of latencies, and where
it settles in front of a modelled batching worker."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from services.admission.limiter import FixedLimit, GradientLimit, GradientSettings


def limiter(**settings: float) -> GradientLimit:
    """Windows of 4 requests, each step taken whole, unless the test says otherwise."""
    defaults: dict[str, float] = dict(batch=4, min_limit=1, max_limit=100, window=4, smoothing=1.0)
    return GradientLimit(GradientSettings(**{**defaults, **settings}))  # type: ignore[arg-type]


def window(
    limit: GradientLimit, latency_s: float, in_flight: int | None = None, late: int = 0
) -> int:
    """One window of requests of `latency_s` each, with the limit in use (or `in_flight`),
    `late` of them missing the deadline they were expected to meet."""
    for index in range(limit.settings.window):
        limit.observe(latency_s, limit.limit if in_flight is None else in_flight, index < late)
    return limit.limit


def test_the_limit_starts_at_the_batch_and_moves_once_per_window() -> None:
    limit = limiter(batch=16)
    assert limit.limit == 16
    for _ in range(3):
        limit.observe(0.1, 16)
    assert limit.limit == 16 and limit.baseline_s is None  # the window is not closed yet
    limit.observe(0.1, 16)
    assert limit.baseline_s == pytest.approx(0.1)
    assert limit.estimate == pytest.approx(16 + 4)  # nothing queued: + sqrt(16)


def test_nothing_queued_grows_the_limit_by_its_square_root() -> None:
    limit = limiter()
    assert window(limit, 0.1) == 6  # 4 + 2
    assert window(limit, 0.1) == 8  # 6 + 2.449
    assert window(limit, 0.12) == 11  # 1.2x the baseline: within the 1.25 tolerance
    assert limit.estimate == pytest.approx(4 + 2 + 6**0.5 + (6 + 6**0.5) ** 0.5)


def test_queueing_shrinks_the_limit_by_the_gradient_and_at_most_by_half() -> None:
    limit = limiter(max_limit=100)
    limit.estimate = 40.0
    window(limit, 0.1)  # the baseline, 40 -> 46.3
    limit.estimate = 40.0
    assert window(limit, 0.2) == 25  # twice the baseline: 40 * 1.25 / 2
    assert window(limit, 10.0) == 12  # 100 times it: halved, not 25 * 0.0125
    assert limit.baseline_s == pytest.approx(0.1)


def test_latency_alone_never_takes_the_limit_below_the_batch() -> None:
    limit = limiter(batch=8, max_limit=10)
    window(limit, 0.1)
    assert window(limit, 0.1) == 10  # 8 -> 10.8, capped
    for _ in range(5):
        window(limit, 5.0)
    assert limit.limit == 8  # the workers' batch stays full however slow it is


def test_requests_late_for_their_expected_deadline_shrink_it_below_the_batch() -> None:
    limit = limiter(batch=32, min_limit=4)
    window(limit, 0.1)  # the baseline: 32 -> 37.66
    limit.estimate = 32.0
    assert window(limit, 0.1, late=1) == 24  # a quarter of the window late: 32 * 0.75
    assert window(limit, 0.1, late=4) == 12  # all of it: halved at most
    for _ in range(10):
        window(limit, 0.1, late=4)
    assert limit.limit == 4  # min_limit


def test_below_the_batch_a_window_without_lateness_grows_the_limit_back_whatever_its_latency() -> (
    None
):
    limit = limiter(batch=32, min_limit=4)
    window(limit, 0.1)  # the baseline
    limit.estimate = 12.0
    assert window(limit, 0.3, late=0) == 15  # 3x the baseline, yet 12 + sqrt(12)
    assert window(limit, 0.3, late=0) == 19  # 15.46 + sqrt(15.46)
    assert window(limit, 0.3, late=0, in_flight=2) == 23  # idle or not: back toward the batch
    assert window(limit, 0.3, late=0) == 28
    assert window(limit, 0.3, late=0) == 32  # capped at the batch ...
    assert window(limit, 0.3, late=0) == 32  # ... where latency alone holds it


def test_lateness_within_the_estimates_tolerance_does_not_shrink_the_limit() -> None:
    # The service estimate covers 90% of recent requests: a tenth may run over it.
    limit = limiter(batch=40, window=20, late_tolerance=0.1)
    window(limit, 0.1)  # the baseline: 40 -> 46.32
    limit.estimate = 40.0
    assert window(limit, 0.1, late=2) == 46  # 2 of 20 late: grows as if none were
    limit.estimate = 40.0
    assert window(limit, 0.1, late=3) == 34  # 3 of 20: shrinks by that share, 40 * 0.85


def test_a_lightly_loaded_gateway_does_not_grow_its_limit_but_still_shrinks_it() -> None:
    limit = limiter()
    limit.estimate = 20.0
    assert window(limit, 0.1, in_flight=9) == 20  # 9 of 20 in use: no reason to grow
    assert window(limit, 0.1, in_flight=10) == 24  # half in use: grows
    assert window(limit, 0.3, in_flight=2) == 12  # 3x the baseline queues, load or not


def test_the_baseline_is_the_lowest_recent_window_at_the_batch() -> None:
    limit = limiter(baseline_windows=2)
    window(limit, 0.1)  # at the batch: the baseline, 4 -> 6
    # Above the batch a slower window does not join the baseline (it would creep up with
    # the queue it measures) ...
    assert window(limit, 0.2) == 4  # 2x: 6 * 0.625 = 3.75, not below the batch
    assert window(limit, 0.2) == 4  # at the batch now: joins it, 2x the 0.1 still there
    assert limit.baseline_s == pytest.approx(0.1)
    # ... but at the batch the old one is forgotten after baseline_windows: now 0.2 is it.
    assert window(limit, 0.2) == 6
    assert limit.baseline_s == pytest.approx(0.2)
    assert window(limit, 0.05) == 8  # a lower window joins it wherever the limit is
    assert limit.baseline_s == pytest.approx(0.05)


def test_smoothing_takes_part_of_each_step() -> None:
    whole = limiter()
    half = limiter(smoothing=0.5)
    for limit in (whole, half):
        limit.estimate = 16.0
        window(limit, 0.1)
    assert whole.estimate == pytest.approx(20.0)
    assert half.estimate == pytest.approx(18.0)


def batching_worker(batch: int, step_s: float = 0.1) -> Callable[[int], float]:
    """Latency per output token of a worker running `n` requests: one step serves up to
    `batch` of them (a little slower as it fills), the rest wait for a place in it."""

    def latency(n: int) -> float:
        step = step_s * (1 + 0.002 * min(n, batch))
        return step * max(1.0, n / batch)

    return latency


def settle(limit: GradientLimit, latency_of: Callable[[int], float], windows: int) -> list[int]:
    """The limits over `windows` windows of a worker kept full at the limit."""
    return [window(limit, latency_of(limit.limit)) for _ in range(windows)]


def test_the_limit_settles_near_the_workers_batch_and_follows_more_workers() -> None:
    limit = GradientLimit(GradientSettings(batch=64, max_limit=256))
    final = settle(limit, batching_worker(64), 200)[-50:]
    # Past the batch the extra requests wait in the engine; the limit never strays far.
    assert min(final) >= 64 and max(final) <= 64 * 1.5, final
    # A second worker doubles the batch: the limit grows into it.
    final = settle(limit, batching_worker(128), 200)[-50:]
    assert min(final) >= 110 and max(final) <= 128 * 1.5, final
    # ... and comes back to the floor when it leaves.
    final = settle(limit, batching_worker(64), 200)[-50:]
    assert max(final) <= 64 * 1.5, final


def test_fixed_limit_ignores_latency() -> None:
    fixed = FixedLimit(12)
    fixed.observe(100.0, 12, late=True)
    assert fixed.limit == 12


@pytest.mark.parametrize(
    "settings",
    [
        dict(min_limit=0),
        dict(min_limit=10, batch=5),
        dict(batch=10, max_limit=5),
        dict(tolerance=0.9),
        dict(window=0),
        dict(max_decrease=0.0),
        dict(smoothing=0.0),
    ],
)
def test_bad_settings_are_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        GradientSettings(**settings)  # type: ignore[arg-type]
