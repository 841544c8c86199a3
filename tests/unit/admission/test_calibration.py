from __future__ import annotations

import pytest

from services.admission.calibration import ServiceCalibration


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
