"""Benchmark statistics follow vLLM's serving-benchmark definitions."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvmesh.bench_report import RequestResult, Slo, percentile, plot_results, summarize
from kvmesh.loadgen import LoadSpec, arrival_gaps, build_requests


def result(ttft: float, e2e: float, tokens: int, ok: bool = True) -> RequestResult:
    return RequestResult(ok=ok, start_s=0.0, output_tokens=tokens, ttft_s=ttft, e2e_s=e2e)


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert math.isnan(percentile([], 50))


def test_tpot_excludes_the_first_token() -> None:
    assert result(0.1, 1.1, 11).tpot_s == pytest.approx(0.1)
    assert math.isnan(result(0.1, 0.1, 1).tpot_s)


def test_summary_counts_throughput_and_goodput() -> None:
    results = [
        result(0.1, 1.1, 11),  # meets both SLOs
        result(0.5, 1.5, 11),  # TTFT too slow
        result(0.1, 3.1, 11),  # TPOT 0.3 too slow
        result(math.nan, math.nan, 0, ok=False),
    ]
    summary = summarize(results, duration_s=2.0, slo=Slo(ttft_s=0.2, tpot_s=0.2))
    assert (summary["completed"], summary["failed"]) == (3, 1)
    assert summary["output_token_throughput"] == pytest.approx(33 / 2.0)
    assert summary["goodput"] == pytest.approx(0.5)
    assert summary["ttft"]["p50_ms"] == pytest.approx(100.0)


def test_requests_are_reproducible_and_workloads_differ() -> None:
    spec = LoadSpec(num_requests=8, workload="prefix", input_words=4, prefix_words=16, seed=3)
    first, again = build_requests(spec), build_requests(spec)
    assert first == again
    assert len({r.prompt.text.split()[0:16].__repr__() for r in first}) == 1  # shared prefix
    mixed = build_requests(LoadSpec(num_requests=40, workload="mixed", seed=1))
    assert {r.priority for r in mixed} == {1, 2}


def test_poisson_gaps_have_the_requested_mean_rate() -> None:
    gaps = arrival_gaps(LoadSpec(num_requests=4000, rate=20.0, seed=5))
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.1)
    assert arrival_gaps(LoadSpec(num_requests=3)) == [0.0, 0.0, 0.0]


def test_plot_is_written(tmp_path: Path) -> None:
    results = [result(0.1 + i / 100, 1.0 + i / 10, 10) for i in range(20)]
    path = tmp_path / "bench.png"
    plot_results(results, summarize(results, 5.0, Slo()), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_without_matplotlib_are_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib comes with the kvmesh[bench] extra; without it --plot says so before the run."""
    from kvmesh import bench_report
    from kvmesh.errors import FailedPrecondition

    bench_report.check_plotting()  # installed here (make install pulls the bench extra)
    monkeypatch.setattr(bench_report.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FailedPrecondition, match=r"pip install 'kvmesh\[bench\]'"):
        bench_report.check_plotting()
