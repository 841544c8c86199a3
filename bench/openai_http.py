"""OpenAI HTTP door vs gRPC door: what the HTTP translation costs, on one running stack.

    .venv/bin/python -m bench.openai_http [--model smollm2-135m] [--quick]

`kvmesh up`'s disaggregated stack (bench.mesh's), then the same kind of requests (kvmesh.loadgen's
seeded random-word prompts, greedy, EOS ignored, response cache bypassed) through the gateway's
gRPC port with kvmesh.loadgen and through the OpenAI door with streamed POST /v1/completions
(httpx, keep-alive). Two loads:

- one request at a time in pairs, one gRPC and one HTTP request back to back (which goes first
  alternates from pair to pair), each door on one connection kept open for the whole region and
  its own prompts (so neither finds the other's prompt in the prefix cache), short prompts and
  few output tokens so the stack's own TTFT (and its noise) is small: p50 TTFT added by HTTP
  (p50 against p50, and the median of the pairs' differences with its 95% interval; the pairs
  cancel a drift of the machine's speed), goal <= 2 ms;
- `--concurrency` requests in flight, each door twice in the order gRPC, HTTP, HTTP, gRPC (so a
  drift of the machine's speed counts against both): output tokens/s, goal HTTP >= 0.97x gRPC.

Every timed region records the load average, the cores other processes and the hypervisor
(steal) took meanwhile and the cores each service of the stack used (bench.peers.timed_region);
a region disturbed by them is run again on fresh prompts, both are kept, and the figures come
from the undisturbed ones. TTFT is the client's: send to the first token-carrying chunk (SSE
event or gRPC message). Writes bench/results/openai_http.json and .png and the "OpenAI HTTP
door" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.mesh import OnDone, advancing, running_stack
from bench.peers import DISTURBED_CORES, is_disturbed, machine, timed_region
from bench.report import (
    publish,
    repeat_command,
    save_figure,
    with_quick_defaults,
)
from kvmesh.bench_report import RequestResult, Slo, percentile, summarize
from kvmesh.client import gateway_channel
from kvmesh.loadgen import LoadSpec, build_requests, measure, run_load
from kvmesh.v1 import gateway_pb2, gateway_pb2_grpc

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


def http_client(base_url: str, connections: int) -> httpx.AsyncClient:
    """The door's client: keep-alive, up to `connections` at once."""
    limits = httpx.Limits(max_connections=connections + 4)
    return httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600)


async def http_load(
    base_url: str, spec: LoadSpec, on_done: OnDone
) -> tuple[list[RequestResult], float]:
    """run_load's schedule (all at once, at most `concurrency` in flight) through the door."""
    requests = build_requests(spec)
    async with http_client(base_url, max(spec.concurrency, 1)) as http:
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
    args: argparse.Namespace,
    *,
    requests: int,
    concurrency: int,
    output: int,
    seed: int,
    words: int | None = None,
) -> LoadSpec:
    return LoadSpec(
        num_requests=requests, concurrency=concurrency,
        input_words=args.prompt_words if words is None else words,
        output_tokens=output, model=args.model, seed=seed,
    )  # fmt: skip


async def until_calm(measure: Callable[[int], Awaitable[dict[str, Any]]]) -> list[dict[str, Any]]:
    """`measure(attempt)` in a timed region (its "region"); a disturbed one is measured again
    once (attempt 1: fresh prompts), both kept, the repeat marked."""
    runs = []
    for attempt in range(2):
        with timed_region() as region:
            run = await measure(attempt)
        run["region"] = asdict(region)
        if attempt:
            run["repeat_of_disturbed"] = True
        runs.append(run)
        if not region.disturbed:
            break
    return runs


def calm(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The undisturbed runs (all of them when every one was disturbed)."""
    return [r for r in runs if not is_disturbed(r["region"])] or runs


async def sequential(
    gateway: str, door: str, args: argparse.Namespace, progress: Progress, attempt: int
) -> dict[str, Any]:
    """`--sequential-requests` pairs, one request at a time: a gRPC and an HTTP request back to
    back, the first of the pair alternating; each door on one open connection, its own prompts."""
    pairs = args.sequential_requests
    task = progress.add_task("one at a time, gRPC and HTTP pairs", total=pairs)
    prompts = {
        name: build_requests(
            spec(args, requests=pairs, concurrency=1, output=args.sequential_output,
                 seed=seed + 1_000 * attempt, words=args.sequential_prompt_words)
        )
        for name, seed in (("grpc", 10_000), ("http", 20_000))
    }  # fmt: skip
    results: dict[str, list[RequestResult]] = {"grpc": [], "http": []}
    async with gateway_channel(gateway, None) as channel, http_client(door, 1) as http:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        # Each connection's set-up, untimed: the pairs measure requests on open connections.
        [opening] = build_requests(spec(args, requests=1, concurrency=1, output=1, seed=99_998))
        await measure(stub, opening, (), 0.0)
        await measure_http(http, opening, 0.0)
        for index in range(pairs):
            order = ("grpc", "http") if index % 2 == 0 else ("http", "grpc")
            for name in order:
                request = prompts[name][index]
                if name == "grpc":
                    result = await measure(stub, request, (), 0.0)
                else:
                    result = await measure_http(http, request, 0.0)
                results[name].append(result)
            progress.advance(task)
    return {
        "summary": {name: summarize(r, 1.0, Slo()) for name, r in results.items()},
        "ttft_ms": {name: [r.ttft_s * 1000 for r in rs] for name, rs in results.items()},
        "paired": paired(results["grpc"], results["http"]),
    }


def paired(grpc: Sequence[RequestResult], http: Sequence[RequestResult]) -> dict[str, float]:
    """HTTP minus gRPC TTFT of each pair where both completed: median, quartiles, and the
    distribution-free 95% interval of the median (order statistics n/2 -+ 1.96 sqrt(n)/2)."""
    diffs = sorted(
        (h.ttft_s - g.ttft_s) * 1000 for g, h in zip(grpc, http, strict=True) if g.ok and h.ok
    )
    if not diffs:
        return {"pairs": 0}
    n, half = len(diffs), 1.96 * math.sqrt(len(diffs)) / 2
    return {
        "pairs": n,
        "median_ms": percentile(diffs, 50),
        "p25_ms": percentile(diffs, 25),
        "p75_ms": percentile(diffs, 75),
        "ci95_low_ms": diffs[max(0, math.floor(n / 2 - half))],
        "ci95_high_ms": diffs[min(n - 1, math.ceil(n / 2 + half))],
        "http_first_median_ms": statistics.median(diffs_in_order(grpc, http, first="http")),
        "grpc_first_median_ms": statistics.median(diffs_in_order(grpc, http, first="grpc")),
    }


def diffs_in_order(
    grpc: Sequence[RequestResult], http: Sequence[RequestResult], first: str
) -> list[float]:
    """The pairs' differences (ms) where `first` went first (even pairs: gRPC)."""
    start = 0 if first == "grpc" else 1
    return [
        (h.ttft_s - g.ttft_s) * 1000
        for g, h in list(zip(grpc, http, strict=True))[start::2]
        if g.ok and h.ok
    ] or [math.nan]


async def concurrent(
    gateway: str, door: str, args: argparse.Namespace, progress: Progress
) -> dict[str, list[dict[str, Any]]]:
    """`--concurrency` in flight, each door twice: gRPC, HTTP, HTTP, gRPC; a disturbed run is
    run again at once."""
    runs: dict[str, list[dict[str, Any]]] = {"grpc": [], "http": []}
    for round_index, name in enumerate(("grpc", "http", "http", "grpc")):

        async def one_run(
            attempt: int, name: str = name, round_index: int = round_index
        ) -> dict[str, Any]:
            load = spec(args, requests=args.requests, concurrency=args.concurrency,
                        output=args.output_tokens, seed=round_index + 10 * attempt)  # fmt: skip
            label = f"concurrency {args.concurrency}, {name}" + (" (again)" if attempt else "")
            task = progress.add_task(label, total=load.num_requests)
            on_done = advancing(progress, task)
            if name == "grpc":
                results, duration = await run_load(gateway, load, on_done)
            else:
                results, duration = await http_load(door, load, on_done)
            return summarize(results, duration, Slo())

        runs[name] += await until_calm(one_run)
    return runs


def warm_up(args: argparse.Namespace) -> LoadSpec:
    return spec(args, requests=4, concurrency=2, output=4, seed=99_999)


async def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    host = machine()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        starting = progress.add_task("starting the stack", total=None)
        async with running_stack(args, port_offset=PORT_OFFSET) as services:
            progress.remove_task(starting)
            gateway = next(s for s in services if s.name == "gateway").address
            door = f"http://{next(s for s in services if s.http_address).http_address}"
            await run_load(gateway, warm_up(args), lambda _: None)
            await http_load(door, warm_up(args), lambda _: None)
            alone = await until_calm(
                lambda attempt: sequential(gateway, door, args, progress, attempt)
            )
            loaded = await concurrent(gateway, door, args, progress)
    host["load_average_end"] = os.getloadavg()[0]
    return {
        "model": args.model,
        "machine": host,
        "workload": {
            "prompt_words": args.prompt_words,
            "sequential_prompt_words": args.sequential_prompt_words,
            "sequential_requests": args.sequential_requests,
            "sequential_output_tokens": args.sequential_output,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "output_tokens": args.output_tokens,
        },
        "sequential": alone,
        "concurrent": loaded,
        "comparison": comparison(alone, loaded),
    }


def comparison(
    alone: list[dict[str, Any]], loaded: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """The goals' figures, from the last undisturbed sequential run and the undisturbed
    concurrent runs."""
    chosen = calm(alone)[-1]
    summary = chosen["summary"]
    throughput = {
        name: statistics.mean(s["output_token_throughput"] for s in calm(runs))
        for name, runs in loaded.items()
    }
    return {
        "ttft_p50_added_ms": summary["http"]["ttft"]["p50_ms"] - summary["grpc"]["ttft"]["p50_ms"],
        "ttft_mean_added_ms": summary["http"]["ttft"]["mean_ms"]
        - summary["grpc"]["ttft"]["mean_ms"],
        "paired": chosen["paired"],
        "throughput_ratio": throughput["http"] / throughput["grpc"],
        "throughput": throughput,
    }


def verdicts(report: dict[str, Any]) -> list[str]:
    figures = report["comparison"]
    added, ratio, pairs = (
        figures["ttft_p50_added_ms"],
        figures["throughput_ratio"],
        figures["paired"],
    )
    median = pairs["median_ms"]
    if pairs["ci95_high_ms"] <= TTFT_GOAL_MS:
        ttft = "met"
    elif pairs["ci95_low_ms"] > TTFT_GOAL_MS:
        ttft = f"missed by {median - TTFT_GOAL_MS:.1f} ms"
    else:
        ttft = "its interval straddles the goal: not settled"
    tput = "met" if ratio >= THROUGHPUT_GOAL else f"missed by {THROUGHPUT_GOAL - ratio:.3f}x"
    return [
        f"- TTFT added by the HTTP door, one request at a time: median of {pairs['pairs']} paired "
        f"differences {median:+.2f} ms (95% interval {pairs['ci95_low_ms']:+.2f} to "
        f"{pairs['ci95_high_ms']:+.2f} ms; quartiles {pairs['p25_ms']:+.2f} / "
        f"{pairs['p75_ms']:+.2f} ms; gRPC first {pairs['grpc_first_median_ms']:+.2f}, HTTP first "
        f"{pairs['http_first_median_ms']:+.2f} ms); p50 against p50 {added:+.2f} ms, mean "
        f"{figures['ttft_mean_added_ms']:+.2f} ms (goal <= {TTFT_GOAL_MS:.0f} ms: {ttft}).",
        f"- Output tokens/s, HTTP vs gRPC at concurrency {report['workload']['concurrency']}: "
        f"{ratio:.3f}x (goal >= {THROUGHPUT_GOAL}x: {tput}).",
    ]


def region_text(region: dict[str, Any]) -> str:
    """Load average, other processes' and stolen cores, and the gateway's (with its HTTP door)
    and the client's cores."""
    own = region["own_cores"]
    mark = " **disturbed**" if is_disturbed(region) else ""
    return (
        f"{region['seconds']:.0f} s, load {region['load_start']:.1f} -> {region['load_end']:.1f}, "
        f"other processes {region['other_cores']:.2f} cores, steal {region['steal_cores']:.2f}; "
        f"gateway with its HTTP door {own.get('services.admission', 0.0):.2f}, client "
        f"{own.get('bench.openai_http', 0.0):.2f} cores{mark}"
    )


def gateway_cpu_ms(run: dict[str, Any]) -> float:
    """CPU the gateway (with its HTTP door) spent per request of a sequential run, gRPC and HTTP
    requests together (ms)."""
    region = run["region"]
    requests = sum(s["requests"] for s in run["summary"].values())
    return region["own_cores"].get("services.admission", 0.0) * region["seconds"] / requests * 1000


def markdown(report: dict[str, Any], command: str) -> str:
    work, host = report["workload"], report["machine"]
    lines = [
        HEADING,
        "",
        f"`{command}` — model `{report['model']}` on {host['cpu']} (CPU family "
        f"{host['cpu_family']} model {host['cpu_model']}, {host['cores']} cores; load average "
        f"{host['load_average_start']:.1f} at the start, {host['load_average_end']:.1f} at the "
        "end). One `kvmesh up` disaggregated stack; gRPC: kvmesh.loadgen on the gateway's port; "
        "HTTP: streamed POST /v1/completions to the OpenAI door (httpx), a second listener of the "
        "same gateway. Greedy, EOS ignored, response cache bypassed. One at a time: "
        f"{work['sequential_requests']} pairs (a gRPC and an HTTP request back to back, which "
        "goes first alternating; each door on one kept-open connection, its own prompts), "
        f"{work['sequential_prompt_words']}-word prompts, {work['sequential_output_tokens']} "
        f"output tokens. Concurrent: {work['requests']} requests at concurrency "
        f"{work['concurrency']}, {work['prompt_words']}-word prompts, {work['output_tokens']} "
        "output tokens, each door run twice (gRPC, HTTP, HTTP, gRPC; the mean of the two). "
        "Each timed region records the load average and the cores other processes and the "
        f"hypervisor (steal) took; one where they took over {DISTURBED_CORES} cores is disturbed, "
        "run again at once on fresh prompts, and left out of the figures.",
        "",
        "| load | door | output tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms |",
        "|---|---|---|---|---|---|",
    ]
    for index, run in enumerate(report["sequential"]):
        label = "one at a time" + (" (repeat)" if index else "")
        for name in ("grpc", "http"):
            s = run["summary"][name]
            lines.append(
                f"| {label} | {name} | - | {s['ttft']['p50_ms']:.1f} "
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
    chosen = calm(report["sequential"])[-1]
    lines.append(
        f"- The gateway (with its HTTP door) spent {gateway_cpu_ms(chosen):.1f} ms of CPU per "
        f"one-at-a-time request, gRPC and HTTP together ({work['sequential_output_tokens']} "
        "tokens; not all of it before the first token)."
    )
    failed = sum(s["failed"] for runs in report["concurrent"].values() for s in runs)
    failed += sum(s["failed"] for run in report["sequential"] for s in run["summary"].values())
    if failed:
        lines.append(f"- {failed} requests failed; the figures count completed ones only.")
    lines += ["", "Timed regions:", ""]
    for index, run in enumerate(report["sequential"]):
        lines.append(f"- one at a time{' (repeat)' if index else ''}: {region_text(run['region'])}")
    for name in ("grpc", "http"):
        for run_index, s in enumerate(report["concurrent"][name]):
            lines.append(
                f"- concurrency {work['concurrency']}, {name} run {run_index + 1}: "
                f"{region_text(s['region'])}"
            )
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """The paired TTFT differences one request at a time, and output tokens/s of each loaded
    run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    chosen = calm(report["sequential"])[-1]
    ttfts = chosen["ttft_ms"]
    diffs = [h - g for g, h in zip(ttfts["grpc"], ttfts["http"], strict=True)]
    left.hist([d for d in diffs if d == d], bins=40, color="C0")
    left.axvline(0, color="k", linewidth=0.8)
    left.axvline(TTFT_GOAL_MS, color="C3", linewidth=0.8, linestyle="--", label="goal")
    left.set_title("TTFT HTTP minus gRPC, pairs one at a time (ms)", fontsize=9)
    left.legend(fontsize=8)
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
    parser.add_argument(
        "--sequential-requests", type=int, default=None, help="pairs; default 1000, quick 20"
    )
    parser.add_argument("--sequential-output", type=int, default=2)
    parser.add_argument("--sequential-prompt-words", type=int, default=8)
    parser.add_argument("--requests", type=int, default=None, help="default 128, quick 32")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=None, help="default 32, quick 16")
    parser.add_argument("--no-write", action="store_true", help="print only")
    return with_quick_defaults(
        parser.parse_args(argv),
        {"sequential_requests": (1000, 20), "requests": (128, 32), "output_tokens": (32, 16)},
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
