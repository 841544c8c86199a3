"""bench.overload's figures from synthetic outcomes: what counts as goodput, shed, refused."""

from __future__ import annotations

import math

import pytest

from bench.overload import Outcome, summary, verdicts


def outcomes() -> list[Outcome]:
    return [
        # Whole and in time: goodput.
        Outcome("interactive", 0.0, ttft_s=0.2, e2e_s=3.0, finish="FINISH_REASON_LENGTH"),
        Outcome("batch", 0.1, ttft_s=1.0, e2e_s=20.0, finish="FINISH_REASON_STOP"),
        # Whole but too late for its 10 s, and cut by its deadline: not goodput.
        Outcome("interactive", 0.2, ttft_s=8.0, e2e_s=10.5, finish="FINISH_REASON_LENGTH"),
        Outcome("batch", 0.3, ttft_s=29.0, e2e_s=30.0, finish="FINISH_REASON_DEADLINE"),
        # Refused at once, with RetryInfo; and one without.
        Outcome("interactive", 0.4, e2e_s=0.004, finish="RESOURCE_EXHAUSTED", retry_after_s=1.5),
        Outcome("batch", 0.5, e2e_s=0.020, finish="RESOURCE_EXHAUSTED"),
    ]


def test_goodput_counts_whole_answers_within_their_deadline() -> None:
    figures = summary(outcomes(), seconds=2.0, capacity=1.0)
    assert figures["sent"] == 6 and figures["in_deadline"] == 2
    assert figures["goodput_per_s"] == 1.0 and figures["goodput_vs_capacity"] == 1.0
    assert figures["interactive_in_deadline"] == 1 and figures["batch_in_deadline"] == 1
    assert figures["finishes"]["FINISH_REASON_DEADLINE"] == 1


def test_refusals_are_timed_and_their_retry_info_kept() -> None:
    figures = summary(outcomes(), seconds=2.0, capacity=1.0)
    assert figures["shed"] == 2 and figures["shed_rate"] == pytest.approx(2 / 6)
    assert figures["refusal_max_ms"] == pytest.approx(20.0)
    assert figures["refusals_with_retry_info"] == 1
    assert figures["retry_after_p50_s"] == 1.5
    assert figures["interactive_retry_after_p50_s"] == 1.5
    assert math.isnan(figures["batch_retry_after_p50_s"])  # refused without RetryInfo
    # TTFT only of the requests that got a token.
    assert figures["interactive_ttft_p99_ms"] == pytest.approx(200 + 0.99 * 7800)


def test_a_run_without_refusals_has_no_refusal_latency() -> None:
    figures = summary(outcomes()[:4], seconds=2.0, capacity=1.0)
    assert figures["shed"] == 0 and math.isnan(figures["refusal_p99_ms"])


def test_verdicts_say_whether_each_goal_at_3x_is_met() -> None:
    new = summary(outcomes(), seconds=2.0, capacity=1.0)
    old = summary(outcomes()[:3], seconds=2.0, capacity=1.0)  # the same minus its refusals
    report = {
        "runs": [
            {"mode": "new", "load": 3.0, "seconds": 60.0, **new},
            {"mode": "old", "load": 3.0, "seconds": 60.0, **old},
        ]
    }
    lines = verdicts(report)
    assert "side by side at 3.0x: goodput 1.00 vs 1.00/s, shed 33% vs 0%" in lines[0]
    assert "= 1.00x the capacity (old admission: 1.00x)" in lines[1] and "met" in lines[1]
    assert "goal <= 10000 ms: met" in lines[2]
    assert "slowest 20.0 ms" in lines[3] and "met" in lines[3]
    assert verdicts({"runs": []}) == ["- No 3.0x run: the goals were not measured."]
