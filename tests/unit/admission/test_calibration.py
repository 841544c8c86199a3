from __future__ import annotations

import pytest

from services.admission.calibration import ServiceCalibration, WaitCalibration


def test_estimates_stay_as_given_until_enough_requests_finished() -> None:
    calibration = ServiceCalibration(quantile=0.9, window=10, min_samples=3)
    calibration.observe(held_s=4.0, expected_s=2.0)
    calibration.observe(held_s=4.0, expected_s=2.0)
    assert calibration.factor == 1.0
    assert calibration.scaled(3.0) == 3.0
    calibration.observe(held_s=4.0, expected_s=2.0)
    assert calibration.factor == 2.0
    assert calibration.scaled(3.0) == 6.0
    assert calibration.scaled(None) is None


def test_the_factor_is_the_quantile_of_the_recent_ratios() -> None:
    calibration = ServiceCalibration(quantile=0.9, window=10, min_samples=1)
    for ratio in (0.5, 0.8, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 3.0):
        calibration.observe(held_s=ratio * 2.0, expected_s=2.0)
    assert calibration.factor == pytest.approx(1.6)  # 9 of the 10 took at most 1.6x
    # The window keeps the newest 10: while 1.6 is among them it is the 9th of 10; once
    # nine faster ones came only the 3.0 is left of the old, above the quantile.
    for _ in range(8):
        calibration.observe(held_s=1.0, expected_s=2.0)
    assert calibration.factor == pytest.approx(1.6)
    calibration.observe(held_s=1.0, expected_s=2.0)
    # Nine of ten took half the estimate: it stays as the rates give it, never shorter.
    assert calibration.factor == 1.0


def test_nothing_is_learnt_from_an_empty_measure() -> None:
    calibration = ServiceCalibration(min_samples=1)
    calibration.observe(held_s=0.0, expected_s=1.0)
    calibration.observe(held_s=1.0, expected_s=0.0)
    assert calibration.factor == 1.0


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        ServiceCalibration(quantile=0.0)
    with pytest.raises(ValueError):
        ServiceCalibration(window=4, min_samples=5)


def test_the_wait_margin_is_the_quantile_of_overruns_and_never_negative() -> None:
    calibration = WaitCalibration(quantile=0.5, window=4, min_samples=2)
    calibration.observe(waited_s=1.0, expected_s=3.0)  # 2 s sooner than expected
    assert calibration.margin_s == 0.0  # too few yet
    calibration.observe(waited_s=1.0, expected_s=2.0)
    assert calibration.margin_s == 0.0  # sooner is no reason to promise less
    for overrun in (4.0, 5.0):
        calibration.observe(waited_s=1.0 + overrun, expected_s=1.0)
    # -2, -1, 4 and 5 s: the median of four is the second.
    assert calibration.margin_s == 0.0
    calibration.observe(waited_s=7.0, expected_s=1.0)  # the -2 leaves the window of 4
    assert calibration.margin_s == pytest.approx(4.0)
