"""Serving-benchmark statistics, measured the way vLLM's serving benchmark defines them.

TTFT is the time to the first chunk that carries tokens; TPOT is (e2e - TTFT) / (output
tokens - 1); ITL is the gap between consecutive token-carrying chunks; goodput counts the
requests that met every SLO given.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from kvmesh.errors import FailedPrecondition

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    """What one benchmark request measured."""

    ok: bool
    """It finished without an error status."""
    start_s: float
    """When it was sent, seconds since the run started."""
    prompt_tokens: int = 0
    """Prompt tokens the gateway counted."""
    output_tokens: int = 0
    """Tokens received."""
    ttft_s: float = math.nan
    """Time to the first chunk carrying tokens."""
    e2e_s: float = math.nan
    """Time to the end of the stream."""
    itl_s: list[float] = field(default_factory=list)
    """Gaps between consecutive token-carrying chunks."""
    finish_reason: str = ""
    """Why generation stopped."""
    error: str = ""
    """The error status and message, when not ok."""

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first."""
        if self.output_tokens < 2:
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(slots=True, frozen=True)
class Slo:
    """Service-level objectives for goodput; None means no bound."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met_by(self, result: RequestResult) -> bool:
        """The request succeeded within every bound."""
        if not result.ok:
            return False
        if self.ttft_s is not None and not result.ttft_s <= self.ttft_s:
            return False
        return self.tpot_s is None or result.output_tokens < 2 or result.tpot_s <= self.tpot_s


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default); NaN when empty."""
    finite = sorted(v for v in values if not math.isnan(v))
    if not finite:
        return math.nan
    rank = (len(finite) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return finite[low] + (finite[high] - finite[low]) * (rank - low)


def distribution(values: Sequence[float]) -> dict[str, float]:
    """Mean and the reported percentiles, in milliseconds."""
    finite = [v for v in values if not math.isnan(v)]
    stats = {"mean_ms": (sum(finite) / len(finite) * 1000.0) if finite else math.nan}
    for q in PERCENTILES:
        stats[f"p{q}_ms"] = percentile(finite, q) * 1000.0
    return stats


def summarize(results: Sequence[RequestResult], duration_s: float, slo: Slo) -> dict[str, Any]:
    """Every figure the table, the JSON file and the plot show."""
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s > 0 else math.nan,
        "output_token_throughput": output_tokens / duration_s if duration_s > 0 else math.nan,
        "total_token_throughput": (output_tokens + sum(r.prompt_tokens for r in done)) / duration_s
        if duration_s > 0
        else math.nan,
        "goodput": sum(slo.met_by(r) for r in results) / duration_s if duration_s > 0 else math.nan,
        "slo": asdict(slo),
        "ttft": distribution([r.ttft_s for r in done]),
        "tpot": distribution([r.tpot_s for r in done]),
        "itl": distribution([gap for r in done for gap in r.itl_s]),
        "e2e": distribution([r.e2e_s for r in done]),
        "errors": sorted({r.error for r in results if not r.ok}),
    }


def summary_table(summary: dict[str, Any], title: str = "kvmesh bench") -> Table:
    """The latency table (ms) and throughput lines as a rich table."""
    table = Table(title=title)
    table.add_column("metric")
    for column in ("mean", *(f"p{q}" for q in PERCENTILES)):
        table.add_column(column, justify="right")
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = summary[name]
        table.add_row(
            f"{name.upper()} (ms)",
            f"{stats['mean_ms']:.1f}",
            *(f"{stats[f'p{q}_ms']:.1f}" for q in PERCENTILES),
        )
    table.add_section()
    table.add_row("completed / failed", f"{summary['completed']} / {summary['failed']}", "", "", "")
    table.add_row("requests/s", f"{summary['request_throughput']:.2f}", "", "", "")
    table.add_row("output tokens/s", f"{summary['output_token_throughput']:.1f}", "", "", "")
    table.add_row("goodput (req/s)", f"{summary['goodput']:.2f}", "", "", "")
    return table


def check_plotting() -> None:
    """FailedPrecondition unless matplotlib (the kvmesh[bench] extra) is installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise FailedPrecondition("plots need matplotlib: pip install 'kvmesh[bench]'")


def plot_results(results: Sequence[RequestResult], summary: dict[str, Any], path: Path) -> None:
    """TTFT and TPOT over the run, and their distributions, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].scatter([r.start_s for r in done], [r.ttft_s * 1000 for r in done], s=8)
    axes[0].set(title="TTFT by send time", xlabel="send time (s)", ylabel="TTFT (ms)")
    axes[1].hist([r.tpot_s * 1000 for r in done if not math.isnan(r.tpot_s)], bins=30)
    axes[1].set(title="TPOT", xlabel="ms per output token", ylabel="requests")
    names = ["ttft", "tpot", "itl", "e2e"]
    for offset, q in enumerate(PERCENTILES):
        axes[2].bar(
            [i + offset * 0.25 for i in range(len(names))],
            [summary[n][f"p{q}_ms"] for n in names],
            width=0.25,
            label=f"p{q}",
        )
    axes[2].set_xticks([i + 0.25 for i in range(len(names))], [n.upper() for n in names])
    axes[2].set(title="latency percentiles", ylabel="ms", yscale="log")
    axes[2].legend()
    fig.suptitle(
        f"{summary['completed']} requests, {summary['output_token_throughput']:.1f} output tok/s"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
