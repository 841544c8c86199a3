"""bench.overload's figures from synthetic outcomes: what counts as goodput, shed, refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.overload import (
    Outcome,
    Samples,
    arrivals,
    markdown,
    parse_args,
    plot,
    summary,
    timeline,
    verdicts,
)


def outcomes() -> list[Outcome]:
    return [
        # Whole and in time: goodput.
        Outcome("interactive", 0.0, ttft_s=0.2, e2e_s=3.0, finish="FINISH_REASON_LENGTH", tokens=8),
        Outcome("batch", 0.1, ttft_s=1.0, e2e_s=20.0, finish="FINISH_REASON_STOP", tokens=6),
        # Whole but too late for its 10 s, and cut by its deadline: not goodput.
        Outcome(
            "interactive", 0.2, ttft_s=8.0, e2e_s=10.5, finish="FINISH_REASON_LENGTH", tokens=8
        ),
        Outcome("batch", 0.3, ttft_s=29.0, e2e_s=30.0, finish="FINISH_REASON_DEADLINE", tokens=3),
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


def test_goodput_over_the_drain_counts_to_the_last_answer() -> None:
    figures = summary(outcomes(), seconds=2.0, capacity=1.0)
    # The last answer came 0.3 + 30.0 s after the first arrival.
    assert figures["drained_s"] == pytest.approx(30.3)
    assert figures["goodput_drained_per_s"] == pytest.approx(2 / 30.3)
    assert figures["goodput_drained_vs_capacity"] == pytest.approx(2 / 30.3)
    # Admitted but not in time: the late whole answer and the one cut by its deadline.
    assert figures["admitted_not_in_time"] == 2
    assert figures["useful_tokens"] == 14 and figures["wasted_tokens"] == 11


def test_admitted_requests_that_ended_without_a_token_are_counted() -> None:
    expired = Outcome("interactive", 0.0, e2e_s=10.0, finish="FINISH_REASON_DEADLINE")
    figures = summary([*outcomes(), expired], seconds=2.0, capacity=1.0)
    # The one that waited out its deadline; the late answer and the cut one had tokens.
    assert figures["admitted_not_in_time"] == 3 and figures["admitted_without_a_token"] == 1


def test_the_timeline_counts_each_request_when_it_ended() -> None:
    samples = Samples(zero=0.0, at_s=[0.5, 10.2], limit=[64, 32], running=[3, 2],
                      waiting=[0, 1], engine_running=[3, 2], engine_waiting=[0, 0])  # fmt: skip
    rows = timeline(outcomes(), samples, seconds=2.0, gateway=True)
    assert len(rows) == 31  # seconds 0..30, the last answer at 30.3 s
    assert sum(row["sent"] for row in rows) == 6 and rows[0]["sent"] == 6
    assert rows[3]["in_time"] == 1 and rows[3]["useful_tokens"] == 8  # ended at 3.0 s
    assert rows[10]["late"] == 1 and rows[10]["wasted_tokens"] == 8  # the 10.7 s answer
    assert rows[30]["late"] == 1 and rows[30]["wasted_tokens"] == 3  # cut at 30.3 s
    assert rows[0]["refused"] == 2
    assert rows[0]["limit"] == 64 and rows[10]["limit"] == 32 and "limit" not in rows[5]
    # Through the old gateway the new one's samples say nothing of the run.
    old = timeline(outcomes(), samples, seconds=2.0, gateway=False)
    assert "limit" not in old[0] and old[0]["engine_running"] == 3


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
    assert "side by side at 3.0x: goodput 0.07 vs 0.10/s over arrivals and drain" in lines[0]
    assert "1.00 vs 1.00/s per second of arrivals, shed 33% vs 0%" in lines[0]
    # The goal is on the drained figure: 2 in time over 30.3 s is missed ...
    assert "= 0.07x the capacity (old admission: 0.10x) (goal >= 0.8x: missed)" in lines[1]
    assert "per second of arrivals 1.00/s = 1.00x" in lines[1]
    assert "goal <= 10000 ms: met" in lines[2]
    assert "slowest 20.0 ms" in lines[3] and "0 at 50 ms or later" in lines[3]
    assert "met" in lines[3]
    # ... and one slow refusal (2 s) misses the refusal goal.
    slow = Outcome("batch", 0.6, e2e_s=2.0, finish="RESOURCE_EXHAUSTED", retry_after_s=0.5)
    report["runs"][0] = {
        "mode": "new", "load": 3.0, "seconds": 60.0,
        **summary([*outcomes(), slow], seconds=2.0, capacity=1.0),
    }  # fmt: skip
    assert "1 at 50 ms or later" in verdicts(report)[3]
    assert "missed" in verdicts(report)[3]
    assert verdicts({"runs": []}) == ["- No 3.0x run: the goals were not measured."]


def test_the_section_and_the_plot_are_written_from_a_report(tmp_path: Path) -> None:
    samples = Samples(zero=0.0, at_s=[0.5], limit=[64], running=[3], waiting=[0],
                      engine_running=[3], engine_waiting=[0])  # fmt: skip
    region = {"seconds": 1.0, "load_start": 1.0, "load_end": 1.0, "other_cores": 0.0}
    runs = [
        {"mode": mode, "load": 3.0, "seconds": 2.0, "region": region,
         **summary(outcomes(), seconds=2.0, capacity=1.0),
         "timeline": timeline(outcomes(), samples, 2.0, mode == "new")}
        for mode in ("old", "new")
    ]  # fmt: skip
    report = {
        "machine": {"cpu": "test", "cores": 2, "load_average_start": 1.0, "load_average_end": 1.0},
        "capacity": {"requests_per_s": 1.0, "tokens_per_s": 32.0, "clients": 64, "seconds": 30,
                     "counted_from_s": 5.0, "region": region,
                     "finishes": {"FINISH_REASON_LENGTH": 30}},
        "workload": {"mode": "colocated", "prompt_words": 48, "output_tokens": 32,
                     "seconds": 2, "goal_seconds": 2},
        "runs": runs,
    }  # fmt: skip
    section = markdown(report, "python -m bench.overload")
    assert "| 3.0x | new | 3.00 | 0.07 | 0.07x | 1.00 | 30.3 |" in section
    assert "| 2 (11) |" in section  # admitted not in time (their tokens)
    assert "1.00 whole answers/s (32 output tokens/s over the tokens of an answer)" in section
    assert "with deadlines of 300 s (0 of its requests cut by one)" in section
    plot(report, tmp_path / "overload.png")
    assert (tmp_path / "overload.png").stat().st_size > 0


def test_both_modes_get_the_same_arrivals_with_prompts_of_their_own() -> None:
    args = parse_args([])
    old, new = (arrivals(3.0, 20.0, mode, args) for mode in ("old", "new"))
    assert [(at, kind) for at, kind, _ in old] == [(at, kind) for at, kind, _ in new]
    assert 30 < len(old) < 90  # Poisson at 3/s over 20 s
    assert all(0 < at < 20.0 for at, _, _ in old)
    prompts = {mode: [m.prompt.text for _, _, m in planned] for mode, planned in
               (("old", old), ("new", new))}  # fmt: skip
    # No prompt of one mode's run is sent in the other's (the prefix cache would serve it).
    assert not set(prompts["old"]) & set(prompts["new"])
    assert arrivals(3.0, 20.0, "old", args)[0][2] == old[0][2]  # the same plan again
