"""Admission benchmark: interactive TTFT alone vs under saturating batch load, and response-cache
hit latency with the memory and the Redis backend.

    python -m bench.admission [--model smollm2-135m] [--interactive 40] [--batch-clients 8]

Starts its own mesh (one colocated worker, the router, a memory and a Redis cache service, and
one gateway per `--batch-max-in-flight` value), writes bench/results/admission.json and the
"Admission" section of BENCHMARKS.md (other sections are left as they are).

TTFT is measured by the client: from sending the request to receiving the first token chunk.
Batch load: `--batch-clients` clients, each sending batch requests back to back (EOS ignored),
more than the gateway lets in at once, so the batch queue never empties. Cache hits: one answer
is stored, then asked for again and again; the latency is the whole request (send -> Finished).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
import yaml

import kvmesh
from bench.report import BENCHMARKS, write_results, write_section
from kvmesh.loadgen import WORDS
from kvmesh.stack import StackService
from kvmesh.supervisor import Child, Supervisor

SECTION = "## Admission"
REDIS_URL = "redis://127.0.0.1:6379/0"
TTFT_GOAL_RATIO = 1.5


@dataclass(slots=True, frozen=True)
class Summary:
    """Latency percentiles in milliseconds."""

    n: int
    p50_ms: float
    p99_ms: float
    mean_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Summary:
        ordered = sorted(seconds)
        p99_index = min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))
        return cls(
            n=len(ordered),
            p50_ms=statistics.median(ordered) * 1000,
            p99_ms=ordered[p99_index] * 1000,
            mean_ms=statistics.fmean(ordered) * 1000,
        )


@dataclass(slots=True)
class LoadedRun:
    """Interactive TTFT while batch clients saturate one gateway."""

    batch_max_in_flight: int
    ttft: Summary
    queue_max_ms: float
    """Longest time an interactive request waited in the admission queue."""
    p50_ratio: float
    p99_ratio: float
    batch_tokens_per_s: float


@dataclass(slots=True)
class Report:
    model: str
    machine: str
    interactive_alone: Summary
    under_load: list[LoadedRun] = field(default_factory=list)
    cache_hits: dict[str, Summary] = field(default_factory=dict)


@dataclass(slots=True)
class Mesh:
    supervisor: Supervisor
    gateways: dict[int, str]
    """batch_max_in_flight -> gateway address (memory response cache)."""
    redis_gateway: str
    redis_prefix: str


def quiet(name: str, line: str) -> None:
    if " ERROR " in line or "Traceback" in line:
        print(f"{name:>12} | {line}", file=sys.stderr)


async def start(supervisor: Supervisor, name: str, module: str, args: list[str]) -> str:
    """Starts a service on a free port; returns its address."""
    service = StackService(name, module, (*args, "--port", "0", "--metrics-port", "-1"),
                           "127.0.0.1", 0, -1)  # fmt: skip
    child: Child = await supervisor.spawn(service)
    await supervisor.wait_ready([child])
    return str(child.ready.result()["address"])


async def start_mesh(args: argparse.Namespace, state: Path) -> Mesh:
    supervisor = Supervisor(printer=quiet)
    worker = await start(
        supervisor, "worker", "services.worker",
        ["--role", "colocated", "--model", args.model, "--tier", args.tier,
         "--num-threads", str(args.threads)],
    )  # fmt: skip
    pools = state / "pools.yaml"
    pools.write_text(yaml.safe_dump({"tiers": [{"name": args.tier, "colocated": [worker]}]}))
    router = await start(supervisor, "router", "services.router", ["--config", str(pools)])
    prefix = f"bench:admission:{uuid.uuid4().hex}:"
    memory_cache = await start(supervisor, "cache-memory", "services.cache", [])
    redis_cache = await start(
        supervisor, "cache-redis", "services.cache",
        ["--redis", REDIS_URL, "--key-prefix", prefix],
    )  # fmt: skip
    # Several gateways on one machine, called over gRPC only: no HTTP door.
    common = ["--router", router, "--model-path", f"{args.tier}={args.model}", "--http-port", "-1"]
    gateways = {}
    for limit in args.batch_max_in_flight:
        gateways[limit] = await start(
            supervisor, f"gateway-b{limit}", "services.admission",
            [*common, "--cache", memory_cache, "--batch-max-in-flight", str(limit),
             "--max-in-flight", str(max(limit + 4, 8))],
        )  # fmt: skip
    redis_gateway = await start(
        supervisor, "gateway-redis", "services.admission", [*common, "--cache", redis_cache]
    )
    return Mesh(supervisor, gateways, redis_gateway, prefix)


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass(slots=True, frozen=True)
class Sample:
    """One interactive request: its TTFT and the part spent in the admission queue."""

    ttft_s: float
    queue_s: float


async def sample(client: kvmesh.Client, text: str, **options: Any) -> Sample:
    started = time.perf_counter()
    async with client.stream(text, **options) as stream:
        await anext(stream)
        first = time.perf_counter() - started
        async for _ in stream:
            pass
        return Sample(first, stream.result.queue_ms / 1000)


async def interactive_samples(
    client: kvmesh.Client, count: int, rng: random.Random
) -> list[Sample]:
    """One interactive request at a time, distinct prompts (no prefix-cache help)."""
    return [
        await sample(client, prompt(rng, 24), max_tokens=4, ignore_eos=True, cache_policy="bypass")
        for _ in range(count)
    ]


async def batch_client(
    client: kvmesh.Client, rng: random.Random, stop: asyncio.Event, tokens: list[int]
) -> None:
    while not stop.is_set():
        result = await client.generate(
            prompt(rng, 48), max_tokens=64, ignore_eos=True, priority="batch", cache_policy="bypass"
        )
        tokens.append(result.usage.completion_tokens)


async def loaded_run(
    address: str, limit: int, args: argparse.Namespace, alone: Summary
) -> LoadedRun:
    rng = random.Random(limit)
    stop = asyncio.Event()
    tokens: list[int] = []
    async with kvmesh.Client(address) as client:
        load = [
            asyncio.create_task(batch_client(client, random.Random(i), stop, tokens))
            for i in range(args.batch_clients)
        ]
        await asyncio.sleep(args.ramp_s)  # every batch slot busy, the batch queue non-empty
        started = time.perf_counter()
        samples = await interactive_samples(client, args.interactive, rng)
        elapsed = time.perf_counter() - started
        done_before = sum(tokens)
        stop.set()
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)
    summary = Summary.of([s.ttft_s for s in samples])
    return LoadedRun(
        limit,
        summary,
        queue_max_ms=max(s.queue_s for s in samples) * 1000,
        p50_ratio=summary.p50_ms / alone.p50_ms,
        p99_ratio=summary.p99_ms / alone.p99_ms,
        batch_tokens_per_s=done_before / elapsed,
    )


async def cache_hit_latencies(address: str, count: int) -> Summary:
    text = f"cache benchmark {uuid.uuid4().hex}"
    async with kvmesh.Client(address) as client:
        first = await client.generate(text, max_tokens=32)
        assert not first.usage.response_cache_hit
        latencies = []
        for _ in range(count):
            started = time.perf_counter()
            hit = await client.generate(text, max_tokens=32)
            latencies.append(time.perf_counter() - started)
            assert hit.usage.response_cache_hit, "expected a response-cache hit"
    return Summary.of(latencies)


async def run(args: argparse.Namespace) -> Report:
    with tempfile.TemporaryDirectory() as state:
        mesh = await start_mesh(args, Path(state))
        try:
            first_gateway = mesh.gateways[args.batch_max_in_flight[0]]
            async with kvmesh.Client(first_gateway) as client:
                await interactive_samples(client, 3, random.Random(-1))  # warm up
                alone_samples = await interactive_samples(
                    client, args.interactive, random.Random(0)
                )
                alone = Summary.of([s.ttft_s for s in alone_samples])
            machine = (
                f"{platform.machine()}, {os.cpu_count()} cores, worker with {args.threads} torch "
                f"threads, load average {os.getloadavg()[0]:.1f} at the start"
            )
            report = Report(args.model, machine, alone)
            print(f"interactive alone: p50 {alone.p50_ms:.0f} ms, p99 {alone.p99_ms:.0f} ms")
            for limit, address in mesh.gateways.items():
                loaded = await loaded_run(address, limit, args, alone)
                report.under_load.append(loaded)
                print(
                    f"batch_max_in_flight={limit}: p50 {loaded.ttft.p50_ms:.0f} ms, "
                    f"p99 {loaded.ttft.p99_ms:.0f} ms ({loaded.p50_ratio:.2f}x / "
                    f"{loaded.p99_ratio:.2f}x), "
                    f"queue max {loaded.queue_max_ms:.1f} ms, "
                    f"batch {loaded.batch_tokens_per_s:.1f} tok/s"
                )
            report.cache_hits["memory"] = await cache_hit_latencies(first_gateway, args.cache_hits)
            report.cache_hits["redis"] = await cache_hit_latencies(
                mesh.redis_gateway, args.cache_hits
            )
            for backend, hits in report.cache_hits.items():
                print(f"cache hit ({backend}): p50 {hits.p50_ms:.1f} ms, p99 {hits.p99_ms:.1f} ms")
            return report
        finally:
            await mesh.supervisor.stop_all()
            store = redis.Redis.from_url(REDIS_URL)
            stale = list(store.scan_iter(match=mesh.redis_prefix + "*"))
            if stale:
                store.delete(*stale)
            store.close()


def markdown(report: Report, args: argparse.Namespace) -> str:
    alone = report.interactive_alone
    lines = [
        SECTION,
        "",
        f"`python -m bench.admission` — model `{report.model}` on CPU ({report.machine}), one "
        f"colocated worker. Interactive requests: {args.interactive} sequential, 24-word prompts, "
        f"TTFT measured by the client. Batch load: {args.batch_clients} clients sending "
        "64-token batch requests back to back (more than the gateway admits, so the batch "
        f"queue never empties). Goal: loaded p99 within {TTFT_GOAL_RATIO}x of alone.",
        "",
        "| interactive TTFT | batch slots (`--batch-max-in-flight`) | p50 ms | p99 ms "
        "| p50 vs alone | p99 vs alone | longest admission-queue wait ms | batch tokens/s |",
        "|---|---|---|---|---|---|---|---|",
        f"| alone | - | {alone.p50_ms:.0f} | {alone.p99_ms:.0f} | 1.00x | 1.00x | - | - |",
    ]
    for run_ in report.under_load:
        mark = "" if run_.p99_ratio <= TTFT_GOAL_RATIO else " (over goal)"
        lines.append(
            f"| under batch load | {run_.batch_max_in_flight} | {run_.ttft.p50_ms:.0f} "
            f"| {run_.ttft.p99_ms:.0f} | {run_.p50_ratio:.2f}x | {run_.p99_ratio:.2f}x{mark} "
            f"| {run_.queue_max_ms:.1f} | {run_.batch_tokens_per_s:.1f} |"
        )
    lines += [
        "",
        "The admission-queue column is the gateway's own share of an interactive request's "
        "TTFT (interactive requests never wait behind batch ones). In the worker, an "
        "interactive arrival interrupts a step of batch work only between layers (the step is "
        "redone afterwards) and batch prefill chunks sit out the step that computes the "
        "interactive prompt, so what remains is one layer of waiting plus the batch "
        "sequences' decode rows sharing the interactive request's steps.",
        "",
        f"Response-cache hits ({args.cache_hits} sequential, whole request send -> Finished, "
        "32-token answer, gateway budgets in memory):",
        "",
        "| cache backend | p50 ms | p99 ms |",
        "|---|---|---|",
    ]
    for backend, hits in report.cache_hits.items():
        lines.append(f"| {backend} | {hits.p50_ms:.1f} | {hits.p99_ms:.1f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tier", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2, help="worker torch threads")
    parser.add_argument("--interactive", type=int, default=40, help="interactive requests/run")
    parser.add_argument("--batch-clients", type=int, default=8)
    parser.add_argument(
        "--batch-max-in-flight", type=int, nargs="+", default=[1, 2, 4], help="settings to compare"
    )
    parser.add_argument("--ramp-s", type=float, default=3.0, help="batch load before measuring")
    parser.add_argument("--cache-hits", type=int, default=300)
    parser.add_argument("--no-write", action="store_true", help="print only")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    if not args.no_write:
        results = write_results("admission", asdict(report))
        write_section(markdown(report, args))
        print(f"wrote {results} and the {SECTION!r} section of {BENCHMARKS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
