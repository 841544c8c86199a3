"""What the router measures of its workers' speed, fed synthetic samples."""

from __future__ import annotations

import pytest

from services.router.rates import DECODE_HORIZON_S, PrefillFit, RateBook
from tests.fake_clock import FakeClock


def test_prefill_time_is_fitted_as_base_plus_per_token() -> None:
    fit = PrefillFit()
    for tokens in (16, 64, 256, 32, 128):
        fit.add(tokens, 0.02 + 0.0005 * tokens)
    base, per_token = fit.line()
    assert base == pytest.approx(0.02)
    assert per_token == pytest.approx(0.0005)


def test_prompts_of_one_length_give_a_proportional_time() -> None:
    fit = PrefillFit()
    for _ in range(5):
        fit.add(100, 0.2)
    assert fit.line() == (0.0, pytest.approx(0.002))


def test_a_fit_that_would_go_negative_falls_back_to_proportional() -> None:
    fit = PrefillFit()
    fit.add(10, 0.5)  # a slow short one (queued behind others), then fast long ones
    fit.add(100, 0.1)
    fit.add(200, 0.2)
    base, per_token = fit.line()
    assert base == 0.0 and per_token > 0


def test_old_prefill_samples_fade() -> None:
    fit = PrefillFit()
    for _ in range(20):
        fit.add(100, 0.1)
    for _ in range(40):
        fit.add(100, 0.4)  # the worker got busier
    assert fit.line()[1] == pytest.approx(0.004, rel=0.05)


def test_the_step_time_is_the_time_between_tokens_averaged_per_token() -> None:
    clock = FakeClock(100.0)
    book = RateBook(clock)
    book.observe_gap("d0", 1, 0.03)
    assert book.step_s("d0") == pytest.approx(0.03)
    book.observe_gap("d0", 1, 0.01)  # at the same moment: an even average
    assert book.step_s("d0") == pytest.approx(0.02)
    book.observe_gap("d0", 2, 0.1)  # two tokens in one chunk: 50 ms each, counted twice
    assert book.step_s("d0") == pytest.approx(0.14 / 4)
    book.observe_gap("d0", 0, 5.0)  # a chunk without tokens says nothing
    assert book.step_s("d0") == pytest.approx(0.14 / 4)
    assert book.step_s("elsewhere") is None


def test_the_step_time_follows_the_load_over_seconds_not_one_wave_of_prefills() -> None:
    clock = FakeClock(100.0)
    book = RateBook(clock)
    # 60 streams decoding at 100 ms a step for 20 s.
    for _ in range(200):
        clock.now += 0.1
        for _ in range(60):
            book.observe_gap("d0", 1, 0.1)
    assert book.step_s("d0") == pytest.approx(0.1)
    # A wave of prompts makes one gap of every stream 0.5 s: the average moves by a tenth of
    # that wave (0.5 s of 5 s), where an average over the last 50 gaps took all of it.
    clock.now += 0.5
    for _ in range(60):
        book.observe_gap("d0", 1, 0.5)
    wave = book.step_s("d0")
    assert wave is not None and 0.1 < wave < 0.15
    # A lasting change is followed within a few horizons (the faster steps before gave more
    # tokens a second, each counting alike).
    for _ in range(round(5 * DECODE_HORIZON_S / 0.3)):
        clock.now += 0.3
        for _ in range(60):
            book.observe_gap("d0", 1, 0.3)
    assert book.step_s("d0") == pytest.approx(0.3, rel=0.03)


def test_tier_rates_average_the_measured_workers() -> None:
    book = RateBook()
    assert book.tier_rates(["p0"], ["d0"]) is None
    book.observe_prefill("p0", 100, 0.1)
    assert book.tier_rates(["p0"], ["d0"]) is None  # no decode measured yet
    book.observe_prefill("p1", 100, 0.3)
    book.observe_gap("d0", 1, 0.04)
    book.observe_gap("d1", 1, 0.06)
    rates = book.tier_rates(["p0", "p1", "unmeasured"], ["d0", "d1"])
    assert rates is not None
    assert rates.prefill_s_per_token == pytest.approx(0.002)
    assert rates.decode_s_per_token == pytest.approx(0.05)
    assert rates.service_s(100, 11) == pytest.approx(0.2 + 10 * 0.05)
    # Only the workers asked about (those in rotation) count.
    only = book.tier_rates(["p0"], ["d0"])
    assert only is not None and only.decode_s_per_token == pytest.approx(0.04)


def test_prefill_time_follows_the_measured_line() -> None:
    book = RateBook()
    assert book.prefill_s("p0", 1024) is None
    book.observe_prefill("p0", 100, 0.3)
    book.observe_prefill("p0", 500, 1.1)
    assert book.prefill_s("p0", 1024) == pytest.approx(0.1 + 1024 * 0.002)
