"""TLS on vs off: what mutual TLS on every hop costs the mesh.

    .venv/bin/python -m bench.tls [--model smollm2-135m] [--quick] [--rounds 2]

Two of `kvmesh up`'s disaggregated stacks run side by side, the same in all but `--tls` (mesh
secret on in both), on two port ranges. The same requests (bench.mesh's loads: seeded
random-word prompts, greedy, EOS ignored, response cache bypassed) go to one stack, then the
other, alternating for `--rounds` rounds, so a change in the machine's load falls on both; the
idle stack uses no CPU meanwhile. Figures per variant pool the rounds: p50 TTFT one request at
a time, output tokens/s at `--concurrency`. Goals: TLS adds <= 1 ms to p50 TTFT and keeps
>= 0.98x the plaintext output tokens/s.

Writes bench/results/tls.json, bench/results/tls.png and the "TLS on vs off" section of
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.mesh import PORT_OFFSET, advancing, running_stack, specs, warmup_spec
from bench.peers import machine, timed_region
from bench.report import (
    publish,
    repeat_command,
    save_figure,
    with_quick_defaults,
)
from kvmesh.bench_report import RequestResult, Slo, summarize
from kvmesh.loadgen import run_load

HEADING = "## TLS on vs off"
TTFT_GOAL_MS = 1.0
THROUGHPUT_GOAL = 0.98
VARIANTS = ("plaintext", "tls")
OFFSETS = {"plaintext": PORT_OFFSET, "tls": PORT_OFFSET + 100}


def _ca_file(services: Sequence[Any]) -> Path:
    """The CA of a --tls stack, from where its gateway's flags point."""
    gateway = next(s for s in services if s.name == "gateway")
    return Path(gateway.args[gateway.args.index("--tls-ca-file") + 1])


async def measure(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    loads = specs(args)
    results: dict[str, dict[str, list[RequestResult]]] = {
        v: {name: [] for name in loads} for v in VARIANTS
    }
    durations: dict[str, dict[str, float]] = {v: dict.fromkeys(loads, 0.0) for v in VARIANTS}
    other_cores: list[float] = []
    starting = progress.add_task("starting both stacks", total=None)
    async with contextlib.AsyncExitStack() as stacks:
        targets: dict[str, tuple[str, Path | None]] = {}
        for variant in VARIANTS:
            services = await stacks.enter_async_context(
                running_stack(args, OFFSETS[variant], tls=variant == "tls")
            )
            gateway = next(s for s in services if s.name == "gateway").address
            targets[variant] = (gateway, _ca_file(services) if variant == "tls" else None)
        progress.remove_task(starting)
        for gateway, ca in targets.values():
            await run_load(gateway, warmup_spec(loads["concurrent"]), lambda _: None, ca)
        for round_index in range(args.rounds):
            for name, spec in loads.items():
                for variant in VARIANTS:
                    gateway, ca = targets[variant]
                    task = progress.add_task(
                        f"round {round_index + 1}, {name}, {variant}", total=spec.num_requests
                    )
                    with timed_region() as region:
                        done, duration = await run_load(
                            gateway, spec, advancing(progress, task), ca
                        )
                    other_cores.append(region.other_cores)
                    results[variant][name] += done
                    durations[variant][name] += duration
    return {
        **{
            variant: {
                name: summarize(results[variant][name], durations[variant][name], Slo())
                for name in loads
            }
            for variant in VARIANTS
        },
        "other_cores": other_cores,
    }


async def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        figures = await measure(args, progress)
    plain, tls = figures["plaintext"], figures["tls"]
    return {
        "model": args.model,
        "machine": f"{machine()['cpu']}, {platform.machine()}, {os.cpu_count()} cores",
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "workload": {
            "prompt_words": args.prompt_words,
            "output_tokens": args.output_tokens,
            "concurrency": args.concurrency,
            "requests": args.requests,
            "sequential_requests": args.sequential_requests,
            "rounds": args.rounds,
        },
        **figures,
        "comparison": {
            "ttft_p50_added_ms": tls["sequential"]["ttft"]["p50_ms"]
            - plain["sequential"]["ttft"]["p50_ms"],
            "throughput_ratio": tls["concurrent"]["output_token_throughput"]
            / plain["concurrent"]["output_token_throughput"],
        },
    }


def verdicts(report: dict[str, Any]) -> list[str]:
    added = report["comparison"]["ttft_p50_added_ms"]
    ratio = report["comparison"]["throughput_ratio"]
    return [
        f"- p50 TTFT one at a time, TLS minus plaintext: {added:+.2f} ms "
        f"(goal <= {TTFT_GOAL_MS:g} ms: {'met' if added <= TTFT_GOAL_MS else 'missed'})",
        f"- output tokens/s at concurrency {report['workload']['concurrency']}, TLS / plaintext: "
        f"{ratio:.3f}x (goal >= {THROUGHPUT_GOAL}x: "
        f"{'met' if ratio >= THROUGHPUT_GOAL else 'missed'})",
    ]


def markdown(report: dict[str, Any], command: str) -> str:
    work = report["workload"]
    lines = [
        HEADING,
        "",
        f"`{command}` — model `{report['model']}` on CPU ({report['machine']}, load average "
        f"{report['load_average_before']:.1f} at the start, {report['load_average_after']:.1f} "
        "at the end). Two of `kvmesh up`'s disaggregated stacks side by side, identical but for "
        "`--tls` (mutual TLS on every hop: gateway -> router and cache, router -> workers, the "
        "KV pull between the workers; the client -> gateway hop too), the mesh secret on in "
        f"both; {work['prompt_words']}-word prompts, {work['output_tokens']} output tokens, "
        f"greedy; per round {work['requests']} requests at concurrency {work['concurrency']} "
        f"and {work['sequential_requests']} one at a time to each stack in turn, "
        f"{work['rounds']} rounds pooled.",
        "",
        "| load | variant | output tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms |",
        "|---|---|---|---|---|---|",
    ]
    for load, label in (
        ("concurrent", f"concurrency {work['concurrency']}"),
        ("sequential", "one at a time"),
    ):
        for variant in VARIANTS:
            s = report[variant][load]
            lines.append(
                f"| {label} | {variant} | {s['output_token_throughput']:.1f} "
                f"| {s['ttft']['p50_ms']:.1f} | {s['ttft']['p99_ms']:.1f} "
                f"| {s['itl']['p50_ms']:.1f} |"
            )
    others = report.get("other_cores") or [0.0]
    lines += [
        "",
        *verdicts(report),
        f"- other processes kept {min(others):.2f}-{max(others):.2f} cores busy during the "
        f"{len(others)} timed regions (bench.peers.timed_region)",
    ]
    failed = sum(
        report[v][load]["failed"] for v in VARIANTS for load in ("concurrent", "sequential")
    )
    if failed:
        lines.append(f"- {failed} requests failed; the figures count completed ones only.")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Throughput and p50 TTFT, plaintext beside TLS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.2))
    plain, tls = report["plaintext"], report["tls"]
    panels = (
        ("output tokens/s, concurrent", plain["concurrent"]["output_token_throughput"],
         tls["concurrent"]["output_token_throughput"]),
        ("TTFT p50 ms, one at a time", plain["sequential"]["ttft"]["p50_ms"],
         tls["sequential"]["ttft"]["p50_ms"]),
    )  # fmt: skip
    for ax, (title, off, on) in zip(axes, panels, strict=True):
        ax.bar(["plaintext", "TLS"], [off, on], color=["C7", "C0"])
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=8)
    save_figure(fig, path, f"mutual TLS on every hop, {report['model']}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--requests", type=int, default=None, help="default 32, --quick 8")
    parser.add_argument(
        "--sequential-requests", type=int, default=None, help="default 20, --quick 5"
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=None, help="default 64, quick 32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print only")
    return with_quick_defaults(
        parser.parse_args(argv),
        {"requests": (32, 8), "sequential_requests": (20, 5), "output_tokens": (64, 32)},
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=120)
    report = asyncio.run(run(args, console))
    for line in verdicts(report):
        console.print(line)
    if not args.no_write:
        section = markdown(report, repeat_command("bench.tls", args, parse_args))
        console.print(publish("tls", report, section, plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
