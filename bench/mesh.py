"""Mesh vs engine: the whole mesh against the in-process engine on the same workload.

    .venv/bin/python -m bench.mesh [--model smollm2-135m] [--quick]

The same requests (kvmesh.loadgen's seeded random-word prompts, greedy, EOS ignored, response
cache bypassed) go, at a fixed concurrency, first straight into an in-process AsyncEngine, then
through the disaggregated mesh `kvmesh up` starts (gateway -> router -> prefill worker ->
KV hand-off -> decode worker, each a process, on a port offset so a running stack is not
touched). Each is also given the requests one at a time: there the TTFT difference is the pure
cost of the mesh. The figures use kvmesh.bench_report's definitions both ways (output tokens/s
over first send -> last token; TTFT from a request's send to its first token). Goals: mesh
output tokens/s >= 0.9x the engine's; the mesh adds <= 10 ms to p50 TTFT.

Writes bench/results/mesh.json, bench/results/mesh.png and the "Mesh vs engine" section of
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import re
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from bench.report import (
    publish,
    repeat_command,
    save_figure,
    with_quick_defaults,
)
from kvmesh.bench_report import RequestResult, Slo, summarize
from kvmesh.contracts.tokenizer import Tokenizer
from kvmesh.loadgen import LoadSpec, build_requests, run_load
from kvmesh.mesh_keys import write_secret_file
from kvmesh.stack import (
    OPENAI_HTTP_PORT,
    Mode,
    StackOptions,
    StackService,
    mesh_secret_path,
    plan_stack,
    write_pools_file,
)
from kvmesh.supervisor import Supervisor
from kvmesh.up import issue_certificates, start_waves
from kvmesh.v1 import gateway_pb2
from services.worker.backends import create_engine
from services.worker.engine.api import EngineBackend, EngineRequest, SamplingParams
from services.worker.engine.config import EngineConfig

HEADING = "## Mesh vs engine"
THROUGHPUT_GOAL = 0.9
TTFT_GOAL_MS = 10.0
# Far from `kvmesh up`'s default ports (50051.., 9451..) and from the e2e tests' offsets.
PORT_OFFSET = 700
OnDone = Callable[[RequestResult], None]


def specs(args: argparse.Namespace) -> dict[str, LoadSpec]:
    """The two loads: `--concurrency` requests in flight, and one at a time."""
    common = {
        "input_words": args.prompt_words,
        "output_tokens": args.output_tokens,
        "model": args.model,
        "seed": args.seed,
    }
    return {
        "concurrent": LoadSpec(num_requests=args.requests, concurrency=args.concurrency, **common),
        "sequential": LoadSpec(num_requests=args.sequential_requests, concurrency=1, **common),
    }


async def engine_request(
    engine: EngineBackend, request: gateway_pb2.GenerateRequest, ids: list[int], start_s: float
) -> RequestResult:
    """One request on the engine's output stream, timed as kvmesh.loadgen times a gateway's."""
    result = RequestResult(ok=False, start_s=start_s, prompt_tokens=len(ids))
    sampling = SamplingParams(max_tokens=request.sampling.max_tokens, ignore_eos=True)
    sent = time.perf_counter()
    last = sent
    async for output in engine.generate(EngineRequest(request.request_id, ids, sampling)):
        now = time.perf_counter()
        if output.new_token_ids:
            if result.output_tokens == 0:
                result.ttft_s = now - sent
            else:
                result.itl_s.append(now - last)
            last = now
            result.output_tokens += len(output.new_token_ids)
        if output.finish_reason is not None:
            result.finish_reason = output.finish_reason.name
            result.ok = output.error is None
            result.error = output.error or ""
    result.e2e_s = time.perf_counter() - sent
    return result


async def engine_load(
    engine: EngineBackend, tokenizer: Tokenizer, spec: LoadSpec, on_done: OnDone
) -> tuple[list[RequestResult], float]:
    """run_load's schedule (everything at once, at most `concurrency` in flight) on the engine."""
    requests = build_requests(spec)
    prompts = [tokenizer.encode(r.prompt.text) for r in requests]
    limit = asyncio.Semaphore(spec.concurrency)
    zero = time.perf_counter()

    async def one(request: gateway_pb2.GenerateRequest, ids: list[int]) -> RequestResult:
        async with limit:
            result = await engine_request(engine, request, ids, time.perf_counter() - zero)
        on_done(result)
        return result

    results = await asyncio.gather(*(one(r, ids) for r, ids in zip(requests, prompts, strict=True)))
    return list(results), time.perf_counter() - zero


def warmup_spec(spec: LoadSpec) -> LoadSpec:
    """Two short requests that load what the first measured request would otherwise pay for."""
    return LoadSpec(
        num_requests=2, concurrency=1, input_words=spec.input_words, output_tokens=4,
        model=spec.model, seed=spec.seed + 1000,
    )  # fmt: skip


async def measure_engine(
    args: argparse.Namespace, loads: dict[str, LoadSpec], progress: Progress
) -> dict[str, dict[str, Any]]:
    engine = create_engine("native", EngineConfig(model=args.model))
    tokenizer = Tokenizer.from_model_path(args.model)
    await engine.start()
    try:
        await engine_load(engine, tokenizer, warmup_spec(loads["concurrent"]), lambda _: None)
        summaries = {}
        for name, spec in loads.items():
            task = progress.add_task(f"engine, {name}", total=spec.num_requests)
            results, duration = await engine_load(
                engine, tokenizer, spec, advancing(progress, task)
            )
            summaries[name] = summarize(results, duration, Slo())
        return summaries
    finally:
        await engine.shutdown()


def advancing(progress: Progress, task: TaskID) -> OnDone:
    """An on_done callback that moves `task`'s bar by one request."""

    def advance(_: RequestResult) -> None:
        progress.advance(task)

    return advance


def metric(port: int, name: str, labels: str = "") -> float:
    """One sample from the Prometheus endpoint on 127.0.0.1:`port` (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    pattern = re.escape(name + (f"{{{labels}}}" if labels else "")) + r" (\S+)"
    found = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def quiet(name: str, line: str) -> None:
    """Only the services' errors reach the terminal (the progress bar keeps it)."""
    if " ERROR " in line or "Traceback" in line:
        print(f"{name:>10} | {line}", file=sys.stderr)


@contextlib.asynccontextmanager
async def running_mesh(args: argparse.Namespace) -> AsyncIterator[str]:
    """`kvmesh up`'s disaggregated stack (one prefill, one decode worker); yields its gateway."""
    async with running_stack(args) as services:
        yield next(s for s in services if s.name == "gateway").address


@contextlib.asynccontextmanager
async def running_stack(
    args: argparse.Namespace,
    port_offset: int = PORT_OFFSET,
    tls: bool = False,
    mode: Mode = "disaggregated",
    engine: str = "native",
    worker_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> AsyncIterator[list[StackService]]:
    """`kvmesh up --mode MODE --engine ENGINE` (with --tls: its certificates too), on bench
    ports, `worker_args` for every worker and `env` added to every service's environment;
    yields its services once all serve."""
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-mesh-") as state:
        options = StackOptions(
            model=args.model,
            mode=mode,
            engine=engine,
            worker_args=worker_args,
            port_offset=port_offset,
            gateway_port=50051 + port_offset,
            http_port=OPENAI_HTTP_PORT + port_offset,
            state_dir=Path(state),
            tls=tls,
        )
        services = plan_stack(options)
        supervisor = Supervisor(printer=quiet, env=env or {})
        supervisor.check_ports(services)
        write_pools_file(options, [s for s in services if s.role])
        if options.mesh_auth:  # as `kvmesh up` does: the services read it at start
            write_secret_file(mesh_secret_path(options.state_dir))
        if options.tls:
            issue_certificates(options, services)
        try:
            await supervisor.start_all(start_waves(services))
            yield services
        finally:
            await supervisor.stop_all()


async def measure_mesh(
    args: argparse.Namespace, loads: dict[str, LoadSpec], progress: Progress
) -> dict[str, dict[str, Any]]:
    starting = progress.add_task("mesh, starting", total=None)
    async with running_mesh(args) as gateway:
        progress.remove_task(starting)
        await run_load(gateway, warmup_spec(loads["concurrent"]), lambda _: None)
        summaries = {}
        for name, spec in loads.items():
            task = progress.add_task(f"mesh, {name}", total=spec.num_requests)
            results, duration = await run_load(gateway, spec, advancing(progress, task))
            summaries[name] = summarize(results, duration, Slo())
        return summaries


def comparison(engine: dict[str, Any], mesh: dict[str, Any]) -> dict[str, float]:
    """Mesh against engine for one load: throughput ratio and TTFT differences."""
    return {
        "throughput_ratio": mesh["output_token_throughput"] / engine["output_token_throughput"],
        "ttft_p50_added_ms": mesh["ttft"]["p50_ms"] - engine["ttft"]["p50_ms"],
        "ttft_p99_added_ms": mesh["ttft"]["p99_ms"] - engine["ttft"]["p99_ms"],
    }


async def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    loads = specs(args)
    load_before = os.getloadavg()[0]
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        engine = await measure_engine(args, loads, progress)
        mesh = await measure_mesh(args, loads, progress)
    return {
        "model": args.model,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "workload": {
            "prompt_words": args.prompt_words,
            "prompt_tokens_mean": mean_prompt_tokens(args, loads["concurrent"]),
            "output_tokens": args.output_tokens,
            "concurrency": args.concurrency,
            "requests": args.requests,
            "sequential_requests": args.sequential_requests,
        },
        "engine": engine,
        "mesh": mesh,
        "comparison": {name: comparison(engine[name], mesh[name]) for name in loads},
    }


def mean_prompt_tokens(args: argparse.Namespace, spec: LoadSpec) -> float:
    tokenizer = Tokenizer.from_model_path(args.model)
    counts = [len(tokenizer.encode(r.prompt.text)) for r in build_requests(spec)]
    return sum(counts) / len(counts)


def verdicts(report: dict[str, Any]) -> list[str]:
    """One sentence per goal, with the margin by which it is met or missed."""
    loaded, alone = report["comparison"]["concurrent"], report["comparison"]["sequential"]
    ratio = loaded["throughput_ratio"]
    lines = [
        f"- Output tokens/s, mesh vs engine at concurrency {report['workload']['concurrency']}: "
        f"{ratio:.2f}x (goal >= {THROUGHPUT_GOAL}x: "
        + ("met" if ratio >= THROUGHPUT_GOAL else f"missed by {THROUGHPUT_GOAL - ratio:.2f}x")
        + ")."
    ]
    for label, figures in (("one request at a time", alone), ("under the concurrent load", loaded)):
        added = figures["ttft_p50_added_ms"]
        verdict = "met" if added <= TTFT_GOAL_MS else f"missed by {added - TTFT_GOAL_MS:.0f} ms"
        lines.append(
            f"- p50 TTFT added by the mesh, {label}: {added:.1f} ms "
            f"(goal <= {TTFT_GOAL_MS:.0f} ms: {verdict})."
        )
    return lines


def markdown(report: dict[str, Any], command: str) -> str:
    work = report["workload"]
    lines = [
        HEADING,
        "",
        f"`{command}` — model `{report['model']}` on CPU ({report['machine']}, load average "
        f"{report['load_average_before']:.1f} at the start, {report['load_average_after']:.1f} "
        "at the end). Engine: one in-process AsyncEngine with the worker's defaults. Mesh: "
        "`kvmesh up`'s disaggregated stack — gateway -> router -> one prefill and one decode "
        "worker (KV hand-off between them) plus the response cache (bypassed), each its own "
        "process, nothing pinned, torch's default thread count in every worker, so prefill and "
        "decode share the same cores. Same requests both ways: "
        f"{work['prompt_words']}-word prompts ({work['prompt_tokens_mean']:.0f} tokens on "
        f"average), {work['output_tokens']} output tokens, greedy, EOS ignored; "
        f"{work['requests']} requests at concurrency {work['concurrency']}, then "
        f"{work['sequential_requests']} one at a time. The engine runs first, then the mesh, on "
        "a machine shared with other work: compare the load averages before trusting small "
        "differences. Above 1x the mesh can gain from prefill and decode running in two processes "
        "at once, where the engine interleaves them in one step loop.",
        "",
        "| load | path | output tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms |",
        "|---|---|---|---|---|---|",
    ]
    for load, label in (
        ("concurrent", f"concurrency {work['concurrency']}"),
        ("sequential", "one at a time"),
    ):
        for path in ("engine", "mesh"):
            s = report[path][load]
            lines.append(
                f"| {label} | {path} | {s['output_token_throughput']:.1f} "
                f"| {s['ttft']['p50_ms']:.1f} | {s['ttft']['p99_ms']:.1f} "
                f"| {s['itl']['p50_ms']:.1f} |"
            )
    lines += ["", *verdicts(report)]
    failed = sum(report[p][load]["failed"] for p in ("engine", "mesh") for load in ("concurrent",
                 "sequential"))  # fmt: skip
    if failed:
        lines.append(f"- {failed} requests failed; the figures count completed ones only.")
    return "\n".join(lines) + "\n"


def print_table(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"mesh vs engine ({report['model']})")
    for column in ("load", "path", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "failed"):
        table.add_column(column, justify="left" if column in ("load", "path") else "right")
    for load in ("concurrent", "sequential"):
        for path in ("engine", "mesh"):
            s = report[path][load]
            table.add_row(
                load, path, f"{s['output_token_throughput']:.1f}", f"{s['ttft']['p50_ms']:.1f}",
                f"{s['ttft']['p99_ms']:.1f}", str(s["failed"]),
            )  # fmt: skip
    console.print(table)
    for line in verdicts(report):
        console.print(line)


def plot(report: dict[str, Any], path: Path) -> None:
    """Throughput and TTFT, engine beside mesh, for both loads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = ("concurrent", "sequential")
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    panels = (
        ("output tokens/s", lambda s: s["output_token_throughput"]),
        ("TTFT p50 (ms)", lambda s: s["ttft"]["p50_ms"]),
        ("TTFT p99 (ms)", lambda s: s["ttft"]["p99_ms"]),
    )
    width = 0.38
    for ax, (title, value) in zip(axes, panels, strict=True):
        for shift, (route, color) in enumerate((("engine", "C7"), ("mesh", "C0"))):
            xs = [i + (shift - 0.5) * width for i in range(len(loads))]
            ax.bar(xs, [value(report[route][load]) for load in loads], width, label=route,
                   color=color)  # fmt: skip
        ax.set_xticks(range(len(loads)))
        ax.set_xticklabels([f"concurrency {report['workload']['concurrency']}", "one at a time"])
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=8)
    axes[0].legend(fontsize=8)
    save_figure(fig, path, f"mesh vs in-process engine, {report['model']}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--requests", type=int, default=None, help="default 32, --quick 8")
    parser.add_argument("--sequential-requests", type=int, default=None, help="default 8, quick 3")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=None, help="default 64, quick 32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print only")
    return with_quick_defaults(
        parser.parse_args(argv),
        {"requests": (32, 8), "sequential_requests": (8, 3), "output_tokens": (64, 32)},
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=120)
    report = asyncio.run(run(args, console))
    print_table(report, console)
    if not args.no_write:
        section = markdown(report, repeat_command("bench.mesh", args, parse_args))
        console.print(publish("mesh", report, section, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
