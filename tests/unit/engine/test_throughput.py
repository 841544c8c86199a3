"""The throughput meter: a trailing window now, and the most ever sustained."""

from __future__ import annotations

import pytest

from services.worker.engine.throughput import ThroughputMeter
from tests.fake_clock import FakeClock


def test_the_window_average_and_the_peak_it_reached() -> None:
    clock = FakeClock(1000.0)
    meter = ThroughputMeter(window_s=10.0, clock=clock)
    assert (meter.tokens_per_second(), meter.peak_tokens_per_second()) == (0.0, 0.0)
    for _ in range(10):  # 40 tokens a second for 10 s
        meter.record(40)
        clock.now += 1.0
    assert meter.tokens_per_second() == pytest.approx(36.0)  # the first second left the window
    assert meter.peak_tokens_per_second() == pytest.approx(40.0)
    for _ in range(5):  # then slower: 10 a second
        meter.record(10)
        clock.now += 1.0
    assert meter.tokens_per_second() == pytest.approx(21.0)  # 4 s at 40 and 5 s at 10
    assert meter.peak_tokens_per_second() == pytest.approx(40.0)  # what it sustained stays
    clock.now += 60.0
    assert meter.tokens_per_second() == 0.0 and meter.peak_tokens_per_second() == 40.0
