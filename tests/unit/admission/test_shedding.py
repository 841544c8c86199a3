"""The shedding rule: wait + service time against the time left, and the retry-after."""

from __future__ import annotations

import pytest

from kvmesh.service_rates import ServiceRates
from services.admission.shedding import MIN_RETRY_S, judge

RATES = ServiceRates(prefill_base_s=0.05, prefill_s_per_token=0.001, decode_s_per_token=0.04)


def test_service_time_from_the_measured_rates() -> None:
    # 0.05 + 100 * 0.001 to the first token, then 63 gaps of 0.04.
    assert RATES.service_s(100, 64) == pytest.approx(0.15 + 63 * 0.04)
    assert RATES.service_s(100, 1) == pytest.approx(0.15)


def test_rates_survive_the_wire() -> None:
    assert ServiceRates.from_proto(RATES.to_proto()) == pytest.approx(RATES)


def test_admitted_when_wait_and_service_fit() -> None:
    assert judge(10.0, wait_s=2.0, service_s=7.9) is None


def test_shed_when_wait_plus_service_exceed_the_deadline() -> None:
    refusal = judge(10.0, wait_s=2.0, service_s=8.5)
    assert refusal is not None and refusal.reason == "service_time"
    assert "8.500s" in refusal.message and "10.000s left" in refusal.message
    # Back once the queue ahead drained by the 0.5 s it is over.
    assert refusal.retry_after_s == pytest.approx(0.5)


def test_a_request_the_workers_cannot_serve_in_time_even_idle_is_shed() -> None:
    refusal = judge(1.0, wait_s=0.0, service_s=RATES.service_s(100, 64))
    assert refusal is not None and refusal.reason == "service_time"
    # Nothing to wait for: it is over by what the workers need beyond its deadline.
    assert refusal.retry_after_s == pytest.approx(RATES.service_s(100, 64) - 1.0)


def test_the_wait_alone_is_enough_to_shed() -> None:
    refusal = judge(1.0, wait_s=4.0, service_s=None)
    assert refusal is not None and refusal.reason == "deadline"
    assert refusal.retry_after_s == pytest.approx(3.0)


def test_the_retry_after_is_never_shorter_than_its_floor() -> None:
    refusal = judge(1.0, wait_s=1.001, service_s=None)
    assert refusal is not None and refusal.retry_after_s == MIN_RETRY_S


def test_unknown_rates_count_the_wait_only() -> None:
    assert judge(1.0, wait_s=0.5, service_s=None) is None


def test_no_deadline_is_never_shed() -> None:
    assert judge(None, wait_s=100.0, service_s=100.0) is None
