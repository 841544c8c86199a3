"""OpenAI HTTP door vs gRPC door: what the HTTP translation costs, on one running stack.

    .venv/bin/python -m bench.openai_http [--model smollm2-135m] [--quick]

`kvmesh up`'s disaggregated stack (bench.mesh's), then the same kind of requests (kvmesh.loadgen's
seeded random-word prompts, greedy, EOS ignored, response cache bypassed) through the gateway's
gRPC port with kvmesh.loadgen and through the OpenAI door with streamed POST /v1/completions
(httpx, keep-alive, one connection per request in flight). Two loads:

- one request at a time, gRPC and HTTP alternating (each door its own prompts, so neither finds
  the other's prompt in the prefix cache): p50 TTFT added by HTTP, goal <= 2 ms;
- `--concurrency` requests in flight, each door twice in the order gRPC, HTTP, HTTP, gRPC (so a
  drift of the machine's speed counts against both): output tokens/s, goal HTTP >= 0.97x gRPC.

TTFT is the client's: send to the first token-carrying chunk (SSE event or gRPC message).
Writes bench/results/openai_http.json and .png and the "OpenAI HTTP door" section of
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.mesh import OnDone, advancing, running_stack
from bench.report import (
    publish,
    repeat_command,
    save_figure,
    with_quick_defaults,
)
from kvmesh.bench_report import RequestResult, Slo, summarize
from kvmesh.loadgen import LoadSpec, build_requests, run_load
from kvmesh.v1 import gateway_pb2

HEADING = "## OpenAI HTTP door"
TTFT_GOAL_MS = 2.0
PORT_OFFSET = 1100
"""Ports of its own stack: apart from bench.mesh's and bench.tls's, so they may run at once."""
THROUGHPUT_GOAL = 0.97


def completion_body(request: gateway_pb2.GenerateRequest) -> dict[str, Any]:
    """The OpenAI body of one of loadgen's requests (same prompt and sampling)."""
    return {
        "model": request.model,
        "prompt": request.prompt.text,
        "max_tokens": request.sampling.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_policy": "bypass",
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def measure_http(
    http: httpx.AsyncClient, request: gateway_pb2.GenerateRequest, start_s: float
) -> RequestResult:
    """One streamed completion, timed like kvmesh.loadgen times a gRPC stream."""
    result = RequestResult(ok=False, start_s=start_s)
    sent = time.perf_counter()
    last = sent
    try:
        async with http.stream("POST", "/v1/completions", json=completion_body(request)) as reply:
            if reply.status_code != 200:
                result.error = f"HTTP {reply.status_code}: {(await reply.aread()).decode()}"
                return result
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if result.ttft_s != result.ttft_s:  # NaN: the first token
                        result.ttft_s = now - sent
                    else:
                        result.itl_s.append(now - last)
                    last = now
                elif chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    result.finish_reason = chunk["choices"][0]["kvmesh_finish_reason"]
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
        result.e2e_s = time.perf_counter() - sent
        result.ok = result.output_tokens > 0
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


async def http_load(
    base_url: str, spec: LoadSpec, on_done: OnDone
) -> tuple[list[RequestResult], float]:
    """run_load's schedule (all at once, at most `concurrency` in flight) through the door."""
    requests = build_requests(spec)
    limits = httpx.Limits(max_connections=max(spec.concurrency, 1) + 4)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600) as http:
        limit = asyncio.Semaphore(max(spec.concurrency, 1))
        zero = time.perf_counter()

        async def one(request: gateway_pb2.GenerateRequest) -> RequestResult:
            async with limit:
                result = await measure_http(http, request, time.perf_counter() - zero)
            on_done(result)
            return result

        results = await asyncio.gather(*(one(r) for r in requests))
        return list(results), time.perf_counter() - zero


def spec(
    args: argparse.Namespace, *, requests: int, concurrency: int, output: int, seed: int
) -> LoadSpec:
    return LoadSpec(
        num_requests=requests, concurrency=concurrency, input_words=args.prompt_words,
        output_tokens=output, model=args.model, seed=seed,
    )  # fmt: skip


async def sequential(
    gateway: str, door: str, args: argparse.Namespace, progress: Progress
) -> dict[str, list[RequestResult]]:
    """One request at a time, alternating doors; each door its own prompts."""
    task = progress.add_task("one at a time, gRPC and HTTP", total=2 * args.sequential_requests)
    results: dict[str, list[RequestResult]] = {"grpc": [], "http": []}
    for index in range(args.sequential_requests):
        for name, seed in (("grpc", 10_000 + index), ("http", 20_000 + index)):
            one = spec(args, requests=1, concurrency=1, output=args.sequential_output, seed=seed)
            if name == "grpc":
                [result], _ = await run_load(gateway, one, lambda _: None)
            else:
                [result], _ = await http_load(door, one, lambda _: None)
            results[name].append(result)
            progress.advance(task)
    return results


async def concurrent(
    gateway: str, door: str, args: argparse.Namespace, progress: Progress
) -> dict[str, list[dict[str, Any]]]:
    """`--concurrency` in flight, each door twice: gRPC, HTTP, HTTP, gRPC."""
    runs: dict[str, list[dict[str, Any]]] = {"grpc": [], "http": []}
    for round_index, name in enumerate(("grpc", "http", "http", "grpc")):
        load = spec(args, requests=args.requests, concurrency=args.concurrency,
                    output=args.output_tokens, seed=round_index)  # fmt: skip
        task = progress.add_task(f"concurrency {args.concurrency}, {name}", total=load.num_requests)
        on_done = advancing(progress, task)
        if name == "grpc":
            results, duration = await run_load(gateway, load, on_done)
        else:
            results, duration = await http_load(door, load, on_done)
        runs[name].append(summarize(results, duration, Slo()))
    return runs


def warm_up(args: argparse.Namespace) -> LoadSpec:
    return spec(args, requests=4, concurrency=2, output=4, seed=99_999)


async def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        starting = progress.add_task("starting the stack", total=None)
        async with running_stack(args, port_offset=PORT_OFFSET) as services:
            progress.remove_task(starting)
            gateway = next(s for s in services if s.name == "gateway").address
            door = f"http://{next(s for s in services if s.http).address}"
            await run_load(gateway, warm_up(args), lambda _: None)
            await http_load(door, warm_up(args), lambda _: None)
            alone = await sequential(gateway, door, args, progress)
            loaded = await concurrent(gateway, door, args, progress)
    alone_summary = {name: summarize(r, 1.0, Slo()) for name, r in alone.items()}
    throughput = {
        name: sum(s["output_token_throughput"] for s in runs) / len(runs)
        for name, runs in loaded.items()
    }
    return {
        "model": args.model,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "cpu": cpu_name(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "workload": {
            "prompt_words": args.prompt_words,
            "sequential_requests": args.sequential_requests,
            "sequential_output_tokens": args.sequential_output,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "output_tokens": args.output_tokens,
        },
        "sequential": alone_summary,
        "sequential_ttft_ms": {n: [r.ttft_s * 1000 for r in rs] for n, rs in alone.items()},
        "concurrent": loaded,
        "comparison": {
            "ttft_p50_added_ms": alone_summary["http"]["ttft"]["p50_ms"]
            - alone_summary["grpc"]["ttft"]["p50_ms"],
            "ttft_mean_added_ms": alone_summary["http"]["ttft"]["mean_ms"]
            - alone_summary["grpc"]["ttft"]["mean_ms"],
            "throughput_ratio": throughput["http"] / throughput["grpc"],
            "throughput": throughput,
        },
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def verdicts(report: dict[str, Any]) -> list[str]:
    figures = report["comparison"]
    added, ratio = figures["ttft_p50_added_ms"], figures["throughput_ratio"]
    ttft = "met" if added <= TTFT_GOAL_MS else f"missed by {added - TTFT_GOAL_MS:.1f} ms"
    tput = "met" if ratio >= THROUGHPUT_GOAL else f"missed by {THROUGHPUT_GOAL - ratio:.2f}x"
    return [
        f"- p50 TTFT added by the HTTP door, one request at a time: {added:.1f} ms "
        f"(mean {figures['ttft_mean_added_ms']:.1f} ms; goal <= {TTFT_GOAL_MS:.0f} ms: {ttft}).",
        f"- Output tokens/s, HTTP vs gRPC at concurrency {report['workload']['concurrency']}: "
        f"{ratio:.3f}x (goal >= {THROUGHPUT_GOAL}x: {tput}).",
    ]


def markdown(report: dict[str, Any], command: str) -> str:
    work = report["workload"]
    lines = [
        HEADING,
        "",
        f"`{command}` — model `{report['model']}` on {report['cpu']} ({report['machine']}, "
        f"load average {report['load_average_before']:.1f} at the start, "
        f"{report['load_average_after']:.1f} at the end). One `kvmesh up` disaggregated stack; "
        "gRPC: kvmesh.loadgen on the gateway's port; HTTP: streamed POST /v1/completions to the "
        "OpenAI door (httpx), which calls the same gateway. Greedy, EOS ignored, response cache "
        f"bypassed, {work['prompt_words']}-word prompts. One at a time: "
        f"{work['sequential_requests']} requests per door, alternating, "
        f"{work['sequential_output_tokens']} output tokens. Concurrent: {work['requests']} "
        f"requests at concurrency {work['concurrency']}, {work['output_tokens']} output tokens, "
        "each door run twice (gRPC, HTTP, HTTP, gRPC; the mean of the two). On a machine shared "
        "with other work, compare the load averages first: one request at a time takes about "
        '50 ms to its first token on an idle stack here ("Mesh vs engine"), and a 2 ms goal '
        "can only be judged where the run-to-run noise is smaller than that.",
        "",
        "| load | door | output tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("grpc", "http"):
        s = report["sequential"][name]
        lines.append(
            f"| one at a time | {name} | - | {s['ttft']['p50_ms']:.1f} "
            f"| {s['ttft']['p99_ms']:.1f} | {s['itl']['p50_ms']:.1f} |"
        )
    for name in ("grpc", "http"):
        for run_index, s in enumerate(report["concurrent"][name]):
            lines.append(
                f"| concurrency {work['concurrency']} (run {run_index + 1}) | {name} "
                f"| {s['output_token_throughput']:.1f} | {s['ttft']['p50_ms']:.1f} "
                f"| {s['ttft']['p99_ms']:.1f} | {s['itl']['p50_ms']:.1f} |"
            )
    lines += ["", *verdicts(report)]
    failed = sum(s["failed"] for runs in report["concurrent"].values() for s in runs)
    failed += sum(s["failed"] for s in report["sequential"].values())
    if failed:
        lines.append(f"- {failed} requests failed; the figures count completed ones only.")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """TTFT of every one-at-a-time request by door, and output tokens/s of each loaded run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    ttfts = report["sequential_ttft_ms"]
    left.boxplot([ttfts["grpc"], ttfts["http"]], tick_labels=["gRPC", "HTTP"])
    left.set_title("TTFT one request at a time (ms)", fontsize=9)
    runs = report["concurrent"]
    labels = [f"{name} {i + 1}" for name in ("grpc", "http") for i in range(len(runs[name]))]
    values = [s["output_token_throughput"] for name in ("grpc", "http") for s in runs[name]]
    colors = ["C7"] * len(runs["grpc"]) + ["C0"] * len(runs["http"])
    right.bar(labels, values, color=colors)
    right.set_title(
        f"output tokens/s at concurrency {report['workload']['concurrency']}", fontsize=9
    )
    for ax in (left, right):
        ax.tick_params(labelsize=8)
    save_figure(fig, path, f"OpenAI HTTP door vs gRPC door, {report['model']}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--sequential-requests", type=int, default=None, help="default 40, quick 8")
    parser.add_argument("--sequential-output", type=int, default=4)
    parser.add_argument("--requests", type=int, default=None, help="default 64, quick 32")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=None, help="default 32, quick 16")
    parser.add_argument("--no-write", action="store_true", help="print only")
    return with_quick_defaults(
        parser.parse_args(argv),
        {"sequential_requests": (40, 8), "requests": (64, 32), "output_tokens": (32, 16)},
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=120)
    report = asyncio.run(run(args, console))
    for line in verdicts(report):
        console.print(line)
    if not args.no_write:
        section = markdown(report, repeat_command("bench.openai_http", args, parse_args))
        console.print(publish("openai_http", report, section, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
