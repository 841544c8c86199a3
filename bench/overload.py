"""Overload: goodput, shedding and TTFT from 0.5x to 4x capacity, old admission vs new.

    flock -x /tmp/kvmesh-cpu.lock .venv/bin/python -m bench.overload [--quick]

One `kvmesh up` stack (its default mode, the default model; colocated: one worker) and,
beside its gateway (the new admission: adaptive concurrency limit, shedding by the workers'
measured service time), a second gateway on the same router with `--no-adaptive-admission`
(the old admission: fixed `--max-in-flight` 64, shed only when the queue wait alone exceeds a
deadline). The new gateway's concurrency limit is sampled from its metrics every second.
Capacity is measured first: requests completed per second with `--capacity-clients` clients
sending back to back through the old gateway, with deadlines that none reaches
(CAPACITY_DEADLINE_S). Then each gateway gets Poisson arrivals at
each multiple of that capacity (`--loads`), half interactive with a 10 s deadline, half
batch with 30 s, each run drained to its last answer. A request counts toward goodput when
its answer is whole (stop or length) within its deadline, counted both per second from the
first arrival to the last answer (the drain included: what the goal is on) and per second of
arrivals; refused ones (RESOURCE_EXHAUSTED) are timed from send to refusal and their
RetryInfo kept. Each run keeps a timeline, one row per second: requests sent, ended in time,
ended otherwise after admission, refused, the tokens generated for each kind, and the
sampled limit, admitted, queued and engine batch. Goals at 3x: goodput >= 0.8x the capacity,
interactive p99 TTFT within 10 s, every refusal under 50 ms.

Every timed region records the load average and the CPU other processes used meanwhile.
Writes bench/results/overload.json, bench/results/overload.png and the "Overload" section of
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import functools
import math
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.mesh import metric, quiet, running_stack
from bench.peers import machine, timed_region
from bench.report import (
    publish,
    repeat_command,
    save_figure,
    with_quick_defaults,
)
from kvmesh.bench_report import percentile
from kvmesh.client import gateway_channel
from kvmesh.loadgen import WORDS
from kvmesh.rpc_status import error_from_rpc
from kvmesh.stack import StackOptions, StackService
from kvmesh.supervisor import Supervisor
from kvmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

HEADING = "## Overload"
# Far from `kvmesh up`'s default ports and from the other benchmarks' offsets.
PORT_OFFSET = 1300
FIXED_GATEWAY_PORT = 50051 + 50
"""The old gateway's port before the offset."""
DEADLINE_S = {"interactive": 10.0, "batch": 30.0}
CAPACITY_DEADLINE_S = 300.0
"""The deadline of the capacity run's requests: none is cut. With the loads' deadlines, 64
clients starting together on a slower CPU (AMD EPYC Zen 4, 2 cores) sent a first wave that
ran past 10 s: 64 of 256 requests were cut, their work wasted, and the capacity read low."""
PRIORITY = {"interactive": common_pb2.PRIORITY_INTERACTIVE, "batch": common_pb2.PRIORITY_BATCH}
GOAL_LOAD = 3.0
GOODPUT_GOAL = 0.8
REFUSAL_GOAL_MS = 50.0
WHOLE = ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH")
WORKERS = {"colocated": "one colocated worker", "disaggregated": "one prefill, one decode worker"}
MODES = ("old", "new")
"""old: --no-adaptive-admission; new: the default admission."""
OLD_ADMISSION = ("--no-adaptive-admission", "--max-in-flight", "64", "--batch-max-in-flight", "48")
"""The old gateway: the fixed limit and batch share that were the defaults before."""
LIMIT = "kvmesh:admission_concurrency_limit"
GATEWAY_RUNNING = "kvmesh:admission_requests_running"
GATEWAY_WAITING = "kvmesh:admission_requests_waiting"
ENGINE_RUNNING = "kvmesh:num_requests_running"
ENGINE_WAITING = "kvmesh:num_requests_waiting"


@dataclass(slots=True)
class Outcome:
    """One request as its client saw it."""

    kind: str
    """interactive or batch."""
    sent_s: float
    """When it was sent, from the start of its run."""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    finish: str = ""
    """The finish reason, or the gRPC status name of a failed call."""
    retry_after_s: float | None = None
    detail: str = ""
    """A failure's message (Finished.error_message or the gRPC details)."""
    tokens: int = 0
    """Output tokens it received."""

    @property
    def refused(self) -> bool:
        return self.finish == "RESOURCE_EXHAUSTED"

    @property
    def in_time(self) -> bool:
        return self.finish in WHOLE and self.e2e_s <= DEADLINE_S[self.kind]


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def request(rng: random.Random, kind: str, index: int, args: argparse.Namespace) -> Any:
    return gateway_pb2.GenerateRequest(
        request_id=f"overload-{index}-{rng.getrandbits(32):08x}",
        prompt=common_pb2.Prompt(text=prompt(rng, args.prompt_words)),
        sampling=common_pb2.SamplingParams(
            max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True
        ),
        priority=PRIORITY[kind],
        cache_policy=common_pb2.CACHE_POLICY_BYPASS,
    )


async def send(
    stub: gateway_pb2_grpc.GatewayStub,
    message: Any,
    kind: str,
    zero: float,
    deadline_s: float | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> Outcome:
    """One request, timed from its send, with its kind's deadline unless one is given; a
    refusal's RetryInfo kept; `on_tokens` told each chunk's token count as it arrives."""
    sent = time.perf_counter()
    outcome = Outcome(kind, sent - zero)
    call = stub.Generate(timeout=deadline_s or DEADLINE_S[kind])
    try:
        await call.write(gateway_pb2.GenerateClientMessage(request=message))
        await call.done_writing()
        async for event in call:
            which = event.WhichOneof("event")
            if which == "chunk" and event.chunk.token_ids:
                if outcome.ttft_s is None:
                    outcome.ttft_s = time.perf_counter() - sent
                outcome.tokens += len(event.chunk.token_ids)
                if on_tokens is not None:
                    on_tokens(len(event.chunk.token_ids))
            elif which == "finished":
                outcome.finish = common_pb2.FinishReason.Name(event.finished.finish_reason)
                outcome.detail = event.finished.error_message
    except grpc.aio.AioRpcError as error:
        outcome.finish = error.code().name
        outcome.retry_after_s = error_from_rpc(error).retry_after_s
        outcome.detail = error.details() or ""
    outcome.e2e_s = time.perf_counter() - sent
    return outcome


async def closed_loop(
    gateway: str,
    clients: int,
    seconds: float,
    seed: int,
    args: argparse.Namespace,
    progress: Progress,
) -> dict[str, Any]:
    """Capacity: `clients` clients back to back for `seconds`; whole answers per second as
    the tokens streamed after the first third (at most 5 s, once every client has its request
    in) over the tokens of an answer. Counting the answers that end in that time instead
    quantised it by the waves in which the clients' answers end: 5.16 and 7.04 answers/s in
    two runs of the same code on one AMD EPYC Zen 4."""
    task = progress.add_task(f"capacity, {clients} clients", total=None)
    done: list[Outcome] = []
    every: list[Outcome] = []
    ramp_s = min(5.0, seconds / 3)
    counted_tokens = 0

    def count(tokens: int) -> None:
        nonlocal counted_tokens
        if zero + ramp_s <= time.perf_counter() <= stop:
            counted_tokens += tokens

    async with gateway_channel(gateway, None) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        zero = time.perf_counter()
        stop = zero + seconds

        async def client(number: int) -> None:
            rng = random.Random(f"closed-{seed}-{number}")  # fresh prompts per loop and client
            index = 0
            while time.perf_counter() < stop:
                kind = "interactive" if index % 2 == 0 else "batch"
                message = request(rng, kind, index, args)
                outcome = await send(stub, message, kind, zero, CAPACITY_DEADLINE_S, count)
                index += 1
                ended = time.perf_counter()
                every.append(outcome)
                if outcome.finish in WHOLE and zero + ramp_s <= ended <= stop:
                    done.append(outcome)
                    progress.advance(task)

        with timed_region() as region:
            await asyncio.gather(*(client(n) for n in range(clients)))
    progress.remove_task(task)
    tokens_per_s = counted_tokens / (seconds - ramp_s)
    return {
        "clients": clients,
        "seconds": seconds,
        "counted_from_s": ramp_s,
        "completed": len(done),
        "tokens_per_s": tokens_per_s,
        "requests_per_s": tokens_per_s / args.output_tokens,
        "finishes": finish_counts(every),
        "failures": failures(every),
        "region": asdict(region),
    }


def arrivals(
    rate: float, seconds: float, mode: str, args: argparse.Namespace
) -> list[tuple[float, str, Any]]:
    """Poisson arrivals at `rate` for `seconds`, half interactive, half batch: (time, kind,
    request) each. Both modes get the same times and kinds at a rate and prompts of their
    own: the engine's prefix cache would serve a prompt another run sent from the KV that run
    left (the closed loops' prompts are their own too)."""
    times = random.Random(f"arrivals-{rate}")
    prompts = random.Random(f"prompts-{mode}-{rate}")
    planned: list[tuple[float, str, Any]] = []
    at = times.expovariate(rate)
    while at < seconds:
        kind = "interactive" if times.random() < 0.5 else "batch"
        planned.append((at, kind, request(prompts, kind, len(planned), args)))
        at += times.expovariate(rate)
    return planned


async def open_loop(
    gateway: str,
    planned: list[tuple[float, str, Any]],
    on_done: Callable[[], None],
    zero: float,
) -> list[Outcome]:
    """Sends each planned request at its time from `zero` (a time.perf_counter()), drained."""
    async with gateway_channel(gateway, None) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        tasks: list[asyncio.Task[Outcome]] = []
        for at, kind, message in planned:
            await asyncio.sleep(max(0.0, zero + at - time.perf_counter()))
            task = asyncio.create_task(send(stub, message, kind, zero))
            task.add_done_callback(lambda _: on_done())
            tasks.append(task)
        return list(await asyncio.gather(*tasks))


def p99_ms(values: Sequence[float]) -> float:
    return percentile(values, 99) * 1000 if values else math.nan


def p50_ms(values: Sequence[float]) -> float:
    return percentile(values, 50) * 1000 if values else math.nan


def finish_counts(outcomes: Sequence[Outcome]) -> dict[str, int]:
    """How many requests ended with each finish reason or gRPC status."""
    return dict(collections.Counter(o.finish for o in outcomes))


def failures(outcomes: Sequence[Outcome]) -> dict[str, int]:
    """How many requests failed with each message, other than refusals and deadlines
    (their messages carry figures that differ each time)."""
    usual = ("RESOURCE_EXHAUSTED", "FINISH_REASON_DEADLINE")
    failed = (o for o in outcomes if o.detail and o.finish not in usual)
    return dict(collections.Counter(f"{o.finish}: {o.detail[:120]}" for o in failed))


def ended_s(outcomes: Sequence[Outcome], seconds: float) -> float:
    """From the first arrival to the last answer: the arrivals' `seconds` and the drain."""
    return max([seconds, *(o.sent_s + o.e2e_s for o in outcomes)])


def summary(outcomes: Sequence[Outcome], seconds: float, capacity: float) -> dict[str, Any]:
    """The figures of one run. Goodput both ways: per second of arrivals, and over the
    arrivals and the drain after them (the one the goal is on)."""
    refused = [o for o in outcomes if o.refused]
    in_time = [o for o in outcomes if o.in_time]
    wasted = [o for o in outcomes if not o.in_time and not o.refused]
    retry = [o.retry_after_s for o in refused if o.retry_after_s is not None]
    whole_s = ended_s(outcomes, seconds)
    figures: dict[str, Any] = {
        "sent": len(outcomes),
        "offered_per_s": len(outcomes) / seconds,
        "in_deadline": len(in_time),
        "goodput_per_s": len(in_time) / seconds,
        "goodput_vs_capacity": len(in_time) / seconds / capacity,
        "drained_s": whole_s,
        "goodput_drained_per_s": len(in_time) / whole_s,
        "goodput_drained_vs_capacity": len(in_time) / whole_s / capacity,
        "admitted_not_in_time": len(wasted),
        "admitted_without_a_token": sum(o.tokens == 0 for o in wasted),
        "useful_tokens": sum(o.tokens for o in in_time),
        "wasted_tokens": sum(o.tokens for o in wasted),
        "shed": len(refused),
        "shed_rate": len(refused) / len(outcomes) if outcomes else math.nan,
        "refusal_p50_ms": percentile([o.e2e_s for o in refused], 50) * 1000
        if refused
        else math.nan,
        "refusal_p99_ms": p99_ms([o.e2e_s for o in refused]),
        "refusal_max_ms": max((o.e2e_s for o in refused), default=math.nan) * 1000,
        "refusals_over_goal": sum(o.e2e_s * 1000 >= REFUSAL_GOAL_MS for o in refused),
        "refusals_with_retry_info": len(retry),
        "retry_after_p50_s": percentile(retry, 50) if retry else math.nan,
        "retry_after_max_s": max(retry, default=math.nan),
        "finishes": finish_counts(outcomes),
        "failures": failures(outcomes),
    }
    for kind in DEADLINE_S:
        ttfts = [o.ttft_s for o in outcomes if o.kind == kind and o.ttft_s is not None]
        mine = [o for o in outcomes if o.kind == kind]
        figures[f"{kind}_sent"] = len(mine)
        figures[f"{kind}_in_deadline"] = sum(o.in_time for o in mine)
        figures[f"{kind}_ttft_p99_ms"] = p99_ms(ttfts)
        figures[f"{kind}_ttft_p50_ms"] = p50_ms(ttfts)
        waits = [o.retry_after_s for o in mine if o.refused and o.retry_after_s is not None]
        figures[f"{kind}_retry_after_p50_s"] = percentile(waits, 50) if waits else math.nan
    return figures


@contextlib.asynccontextmanager
async def fixed_gateway(services: list[StackService], port_offset: int) -> AsyncIterator[str]:
    """A second gateway on the stack's router with the old admission; yields its address."""
    gateway = next(s for s in services if s.name == "gateway")
    args = list(gateway.args)
    port = FIXED_GATEWAY_PORT + port_offset
    args[args.index("--port") + 1] = str(port)
    args[args.index("--metrics-port") + 1] = "-1"
    args[args.index("--http-port") + 1] = "-1"  # the stack's gateway serves the HTTP door
    old = dataclasses.replace(
        gateway,
        name="gateway-old",
        args=(*args, *OLD_ADMISSION),
        port=port,
        metrics_port=-1,
    )
    supervisor = Supervisor(printer=quiet)
    try:
        child = await supervisor.spawn(old)
        await supervisor.wait_ready([child])
        yield old.address
    finally:
        await supervisor.stop_all()


@dataclass(slots=True)
class Samples:
    """What the mesh showed once a second during a run."""

    zero: float
    """The run's time.perf_counter() zero."""
    at_s: list[float] = dataclasses.field(default_factory=list)
    """When each sample was taken, from the run's zero."""
    limit: list[float] = dataclasses.field(default_factory=list)
    """The new gateway's concurrency limit."""
    running: list[float] = dataclasses.field(default_factory=list)
    """Requests the new gateway had admitted toward the router."""
    waiting: list[float] = dataclasses.field(default_factory=list)
    """Requests in the new gateway's admission queue."""
    engine_running: list[float] = dataclasses.field(default_factory=list)
    """Requests in the worker's engine batch."""
    engine_waiting: list[float] = dataclasses.field(default_factory=list)
    """Requests queued in the worker's engine (beyond its batch)."""
    decode_ms: list[float] = dataclasses.field(default_factory=list)
    """The decode rate the gateways shed by (ListModels' service_rates)."""

    def figures(self) -> dict[str, float]:
        found: dict[str, float] = {}
        for name in ("limit", "engine_running", "engine_waiting", "decode_ms"):
            values = getattr(self, name)
            if values:
                found[f"{name}_min"], found[f"{name}_max"] = min(values), max(values)
                found[f"{name}_mean"] = sum(values) / len(values)
        return found


def gateway_count(port: int, name: str) -> float:
    """A gauge of the gateway summed over its priorities."""
    return sum(metric(port, name, f'priority="{p}"') for p in DEADLINE_S)


@contextlib.asynccontextmanager
async def sampled(
    gateway: StackService, worker: StackService, zero: float
) -> AsyncIterator[Samples]:
    """Samples the new gateway's limit and queue, the engine's batch and queue and the rates
    while the block runs."""
    samples = Samples(zero)

    def scrape() -> tuple[float, ...]:
        return (
            metric(gateway.metrics_port, LIMIT),
            gateway_count(gateway.metrics_port, GATEWAY_RUNNING),
            gateway_count(gateway.metrics_port, GATEWAY_WAITING),
            metric(worker.metrics_port, ENGINE_RUNNING),
            metric(worker.metrics_port, ENGINE_WAITING),
        )

    async def sample(stub: gateway_pb2_grpc.GatewayStub) -> None:
        while True:
            at = time.perf_counter() - zero
            values = await asyncio.to_thread(scrape)
            samples.at_s.append(at)
            for name, value in zip(
                ("limit", "running", "waiting", "engine_running", "engine_waiting"),
                values,
                strict=True,
            ):
                getattr(samples, name).append(value)
            models = await stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=5)
            rates = [m.service_rates for m in models.models if m.HasField("service_rates")]
            if rates:
                samples.decode_ms.append(rates[0].decode_ms_per_token)
            await asyncio.sleep(max(0.0, zero + at + 1.0 - time.perf_counter()))

    async with gateway_channel(gateway.address, None) as channel:
        task = asyncio.create_task(sample(gateway_pb2_grpc.GatewayStub(channel)))
        try:
            yield samples
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


GATEWAY_SAMPLES = ("limit", "running", "waiting")
"""Samples of the new gateway (they say nothing of a run through the old one)."""
ENGINE_SAMPLES = ("engine_running", "engine_waiting")


def timeline(
    outcomes: Sequence[Outcome], samples: Samples, seconds: float, gateway: bool
) -> list[dict[str, float]]:
    """Per second of the run, arrivals to the last answer: requests sent, ended in time, ended
    otherwise after admission (late, cut by the deadline, failed) and refused, by when they
    ended; output tokens of the ones in time (useful) and of the others (wasted); and the last
    sample taken in that second (the new gateway's limit, running and waiting only when
    `gateway`: the run went through it)."""
    length = math.ceil(ended_s(outcomes, seconds))
    counts = ("sent", "in_time", "late", "refused", "useful_tokens", "wasted_tokens")
    rows = [{"t": float(t), **dict.fromkeys(counts, 0.0)} for t in range(length)]
    for o in outcomes:
        rows[min(int(o.sent_s), length - 1)]["sent"] += 1
        row = rows[min(int(o.sent_s + o.e2e_s), length - 1)]
        if o.refused:
            row["refused"] += 1
        elif o.in_time:
            row["in_time"] += 1
            row["useful_tokens"] += o.tokens
        else:
            row["late"] += 1
            row["wasted_tokens"] += o.tokens
    names = (*GATEWAY_SAMPLES, *ENGINE_SAMPLES) if gateway else ENGINE_SAMPLES
    for index, at in enumerate(samples.at_s):
        if 0 <= at < length:
            for name in names:
                rows[int(at)][name] = getattr(samples, name)[index]
    return rows


def given_capacity(per_s: float) -> dict[str, Any]:
    """--capacity: the load's unit given, not measured (runs that compare code paths on a
    machine whose measured capacity varies from run to run load it the same)."""
    with timed_region() as region:
        pass
    return {"given": True, "clients": 0, "seconds": 0.0, "requests_per_s": per_s,
            "finishes": {}, "failures": {}, "region": asdict(region)}  # fmt: skip


def run_seconds(load: float, args: argparse.Namespace) -> float:
    return args.goal_seconds if load == GOAL_LOAD else args.seconds


async def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    report: dict[str, Any] = {"machine": machine(), "runs": []}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        starting = progress.add_task("starting the stack", total=None)
        stack = running_stack(args, args.port_offset, mode=args.mode)
        async with stack as services, fixed_gateway(services, args.port_offset) as old:
            new = next(s for s in services if s.name == "gateway")
            worker = next(s for s in services if s.role in ("colocated", "decode"))
            gateways = {"old": old, "new": new.address}
            progress.remove_task(starting)
            # Warm-up at full load: both gateways learn the model list, the router the
            # workers' rates, the engines see every batch size before anything is timed.
            for seed, address in enumerate(gateways.values(), start=1):
                await closed_loop(
                    address, args.capacity_clients, args.warmup_seconds, seed, args, progress
                )
            capacity = (
                await closed_loop(
                    old, args.capacity_clients, args.capacity_seconds, 0, args, progress
                )
                if args.capacity is None
                else given_capacity(args.capacity)
            )
            report["capacity"] = capacity
            per_s = capacity["requests_per_s"]
            console.print(f"capacity: {per_s:.2f} requests/s {capacity['finishes']}")
            console.print(capacity["failures"])
            if per_s == 0:
                raise SystemExit("no whole answer while measuring capacity: nothing to load")
            for load in args.loads:
                for mode in args.modes:
                    seconds = run_seconds(load, args)
                    expected = round(load * per_s * seconds)
                    task = progress.add_task(f"{mode} admission, {load}x", total=expected)
                    with timed_region() as region:
                        zero = time.perf_counter()
                        async with sampled(new, worker, zero) as samples:
                            outcomes = await open_loop(
                                gateways[mode], arrivals(load * per_s, seconds, mode, args),
                                functools.partial(progress.advance, task), zero,
                            )  # fmt: skip
                    progress.remove_task(task)
                    figures = summary(outcomes, seconds, per_s)
                    figures.update(samples.figures())
                    if mode == "old":  # the new gateway's limit says nothing of this run
                        figures = {k: v for k, v in figures.items() if not k.startswith("limit")}
                    report["runs"].append(
                        {"mode": mode, "load": load, "seconds": seconds,
                         "region": asdict(region), **figures,
                         "timeline": timeline(outcomes, samples, seconds, mode == "new")}
                    )  # fmt: skip
                    console.print(figures["finishes"], figures["failures"], samples.figures())
                    console.print(
                        f"{mode} {load}x: goodput {figures['goodput_per_s']:.2f}/s "
                        f"({figures['goodput_vs_capacity']:.2f}x; over the "
                        f"{figures['drained_s']:.1f} s with the drain "
                        f"{figures['goodput_drained_per_s']:.2f}/s = "
                        f"{figures['goodput_drained_vs_capacity']:.2f}x), wasted "
                        f"{figures['admitted_not_in_time']} admitted requests, "
                        f"{figures['wasted_tokens']} tokens, shed "
                        f"{figures['shed_rate']:.0%}, interactive p99 TTFT "
                        f"{figures['interactive_ttft_p99_ms']:.0f} ms"
                    )
    report["workload"] = {
        "mode": args.mode,
        "prompt_words": args.prompt_words,
        "output_tokens": args.output_tokens,
        "deadlines_s": DEADLINE_S,
        "loads": args.loads,
        "seconds": args.seconds,
        "goal_seconds": args.goal_seconds,
    }
    report["machine"]["load_average_end"] = os.getloadavg()[0]
    return report


def find(report: dict[str, Any], mode: str, load: float) -> dict[str, Any] | None:
    return next((r for r in report["runs"] if r["mode"] == mode and r["load"] == load), None)


def verdicts(report: dict[str, Any]) -> list[str]:
    """One sentence per goal at 3x, with the margin by which it is met or missed."""
    new = find(report, "new", GOAL_LOAD)
    if new is None:
        return [f"- No {GOAL_LOAD}x run: the goals were not measured."]
    old = find(report, "old", GOAL_LOAD)
    ratio = new["goodput_drained_vs_capacity"]
    was = f" (old admission: {old['goodput_drained_vs_capacity']:.2f}x)" if old else ""
    ttft = new["interactive_ttft_p99_ms"]
    refusal = new["refusal_max_ms"]
    side_by_side = (
        f"- New against old admission side by side at {GOAL_LOAD}x: goodput "
        f"{new['goodput_drained_per_s']:.2f} vs {old['goodput_drained_per_s']:.2f}/s over "
        f"arrivals and drain, {new['goodput_per_s']:.2f} vs {old['goodput_per_s']:.2f}/s "
        "per second of arrivals, shed "
        f"{new['shed_rate']:.0%} vs "
        f"{old['shed_rate']:.0%}, deadline finishes "
        f"{new['finishes'].get('FINISH_REASON_DEADLINE', 0)} vs "
        f"{old['finishes'].get('FINISH_REASON_DEADLINE', 0)}."
        if old
        else f"- No old-admission run at {GOAL_LOAD}x to compare with."
    )
    return [
        side_by_side,
        f"- Finished within the deadline at {GOAL_LOAD}x ({new['in_deadline']} of "
        f"{new['sent']} sent in {new['seconds']:.0f} s), counted over the "
        f"{new['drained_s']:.1f} s from the first arrival to the last answer: "
        f"{new['goodput_drained_per_s']:.2f}/s = {ratio:.2f}x the capacity{was} "
        f"(goal >= {GOODPUT_GOAL}x: {'met' if ratio >= GOODPUT_GOAL else 'missed'}); per "
        f"second of arrivals {new['goodput_per_s']:.2f}/s = "
        f"{new['goodput_vs_capacity']:.2f}x. Admitted but not in time: "
        f"{new['admitted_not_in_time']} ({new['admitted_without_a_token']} without a token; "
        f"{new['wasted_tokens']} tokens generated for them, "
        f"{new['useful_tokens']} for the ones in time).",
        f"- Interactive p99 TTFT at {GOAL_LOAD}x: {ttft:.0f} ms (goal <= "
        f"{DEADLINE_S['interactive'] * 1000:.0f} ms: "
        f"{'met' if ttft <= DEADLINE_S['interactive'] * 1000 else 'missed'}).",
        f"- Refusals at {GOAL_LOAD}x: {new['shed']}, slowest {refusal:.1f} ms, p99 "
        f"{new['refusal_p99_ms']:.1f} ms, {new['refusals_over_goal']} at "
        f"{REFUSAL_GOAL_MS:.0f} ms or later, "
        f"{new['refusals_with_retry_info']} with RetryInfo "
        f"(median retry-after {new['retry_after_p50_s']:.2f} s, interactive "
        f"{new['interactive_retry_after_p50_s']:.2f} s, batch "
        f"{new['batch_retry_after_p50_s']:.2f} s) (goal < {REFUSAL_GOAL_MS:.0f} "
        f"ms: {'met' if new['refusals_over_goal'] == 0 else 'missed'}).",
    ]


def limit_range(run_: dict[str, Any]) -> str:
    """The concurrency limit a run had: the old one's fixed 64, the new one's sampled range."""
    if "limit_min" not in run_:
        return OLD_ADMISSION[2] if run_["mode"] == "old" else "-"
    return f"{run_['limit_min']:.0f}-{run_['limit_max']:.0f}"


def markdown(report: dict[str, Any], command: str) -> str:
    cap = report["capacity"]
    work = report["workload"]
    cpu = report["machine"]
    regions = [r["region"] for r in report["runs"]] + [cap["region"]]
    others = [r["other_cores"] for r in regions]
    lines = [
        HEADING,
        "",
        f"`{command}` (under `flock -x /tmp/kvmesh-cpu.lock`) — default model on CPU "
        f"({cpu['cpu']}, {cpu['cores']} cores, load average {cpu['load_average_start']:.1f} at "
        f"the start, {cpu['load_average_end']:.1f} at the end; other processes used "
        f"{min(others):.2f}-{max(others):.2f} cores in the timed regions). `kvmesh up`'s "
        f"{work['mode']} stack ({WORKERS[work['mode']]}, nothing pinned) with two gateways "
        "on its router: **new** = the default admission (adaptive concurrency limit: it "
        "starts at `--workers-batch` 64, latency alone never takes it below that, windows "
        "in which over a tenth of the requests miss the deadline the admission expected them "
        "to meet take it down to `--min-in-flight` 4 and windows without bring it back, at "
        "most `--max-in-flight` 256; the limit column is its range sampled once a second; "
        "batch requests take every slot while no interactive one is about; "
        "shedding by the expected wait, widened by how far its class's recent waits ran "
        "over their estimates, plus the workers' measured service time), **old** = "
        "`--no-adaptive-admission` (fixed "
        f"`--max-in-flight` 64, shed only when the queue wait alone exceeds the deadline). "
        f"Requests: {work['prompt_words']}-word prompts, {work['output_tokens']} output tokens "
        "(EOS ignored), half interactive with a 10 s deadline, half batch with 30 s, Poisson "
        f"arrivals. Capacity: {capacity_text(cap)}. Each load ran {work['seconds']:.0f} s "
        f"({work['goal_seconds']:.0f} s at {GOAL_LOAD}x) and was drained. Goodput: whole "
        "answers within their deadline per second from the first arrival to the last answer "
        "(drained; the goal's), and per second of arrivals; wasted: requests admitted that "
        "did not finish in time, and the tokens generated for them.",
        "",
        "| load | admission | offered/s | goodput/s drained | vs capacity | goodput/s "
        "arrivals | drained s | shed | refusal p99 ms | interactive TTFT p99 ms "
        "| batch TTFT p99 ms | deadline finishes | wasted (tokens) | limit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run_ in report["runs"]:
        lines.append(
            f"| {run_['load']}x | {run_['mode']} | {run_['offered_per_s']:.2f} "
            f"| {run_['goodput_drained_per_s']:.2f} "
            f"| {run_['goodput_drained_vs_capacity']:.2f}x | {run_['goodput_per_s']:.2f} "
            f"| {run_['drained_s']:.1f} | {run_['shed_rate']:.0%} | {run_['refusal_p99_ms']:.1f} "
            f"| {run_['interactive_ttft_p99_ms']:.0f} | {run_['batch_ttft_p99_ms']:.0f} "
            f"| {run_['finishes'].get('FINISH_REASON_DEADLINE', 0)} "
            f"| {run_['admitted_not_in_time']} ({run_['wasted_tokens']}) | {limit_range(run_)} |"
        )
    lines += ["", *verdicts(report)]
    return "\n".join(lines) + "\n"


def capacity_text(cap: dict[str, Any]) -> str:
    if cap.get("given"):
        return f"{cap['requests_per_s']:.2f} requests/s, given with --capacity (not measured)"
    cut = cap["finishes"].get("FINISH_REASON_DEADLINE", 0)
    return (
        f"{cap['requests_per_s']:.2f} whole answers/s ({cap['tokens_per_s']:.0f} output "
        f"tokens/s over the tokens of an answer) with {cap['clients']} clients back to back "
        f"through the old gateway for {cap['seconds']:.0f} s, counted from "
        f"{cap['counted_from_s']:.0f} s, with deadlines of {CAPACITY_DEADLINE_S:.0f} s "
        f"({cut} of its requests cut by one)"
    )


def print_table(report: dict[str, Any], console: Console) -> None:
    table = Table(title="overload: old vs new admission")
    for column in ("load", "admission", "goodput/s drained", "vs cap", "per arrival s",
                   "wasted", "shed", "refusal p99 ms", "int. TTFT p99", "batch TTFT p99",
                   "limit"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in report["runs"]:
        table.add_row(
            f"{r['load']}x", r["mode"], f"{r['goodput_drained_per_s']:.2f}",
            f"{r['goodput_drained_vs_capacity']:.2f}x", f"{r['goodput_vs_capacity']:.2f}x",
            str(r["admitted_not_in_time"]), f"{r['shed_rate']:.0%}",
            f"{r['refusal_p99_ms']:.1f}", f"{r['interactive_ttft_p99_ms']:.0f}",
            f"{r['batch_ttft_p99_ms']:.0f}", limit_range(r),
        )  # fmt: skip
    console.print(table)
    for line in verdicts(report):
        console.print(line)


def plot(report: dict[str, Any], path: Path) -> None:
    """Goodput, shed rate, p99 TTFT and refusal latency against the offered load; below, each
    admission's timeline at the goal's load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(15, 7.4))
    axes = [fig.add_subplot(2, 4, column + 1) for column in range(4)]
    styles = {"old": ("C3", "o"), "new": ("C0", "s")}
    for mode, (color, marker) in styles.items():
        runs = sorted((r for r in report["runs"] if r["mode"] == mode), key=lambda r: r["load"])
        loads = [r["load"] for r in runs]
        axes[0].plot(loads, [r["goodput_drained_vs_capacity"] for r in runs], color=color,
                     marker=marker, label=f"{mode}, drained")  # fmt: skip
        axes[0].plot(loads, [r["goodput_vs_capacity"] for r in runs], color=color,
                     marker=marker, linestyle="--", alpha=0.5,
                     label=f"{mode}, per arrival s")  # fmt: skip
        axes[1].plot(loads, [100 * r["shed_rate"] for r in runs], color=color, marker=marker)
        for kind, style in (("interactive", "-"), ("batch", "--")):
            axes[2].plot(loads, [r[f"{kind}_ttft_p99_ms"] / 1000 for r in runs], color=color,
                         marker=marker, linestyle=style, label=f"{mode} {kind}")  # fmt: skip
        axes[3].plot(loads, [r["refusal_p99_ms"] for r in runs], color=color, marker=marker)
    axes[0].axhline(GOODPUT_GOAL, color="grey", linestyle=":", linewidth=1)
    axes[2].axhline(DEADLINE_S["interactive"], color="grey", linestyle=":", linewidth=1)
    axes[3].axhline(REFUSAL_GOAL_MS, color="grey", linestyle=":", linewidth=1)
    titles = ("goodput / capacity", "shed (%)", "TTFT p99 (s)", "refusal p99 (ms)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("offered load (x capacity)", fontsize=8)
        ax.tick_params(labelsize=8)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    for column, mode in enumerate(styles):
        run_ = find(report, mode, GOAL_LOAD)
        if run_ is not None:
            timeline_axes(fig.add_subplot(2, 2, 3 + column), run_)
    save_figure(fig, path, "overload: old (fixed limit) vs new admission")


def timeline_axes(ax: Any, run_: dict[str, Any]) -> None:
    """One run's seconds: in flight and the limit (left axis), finished in time and wasted
    requests per second (right axis)."""
    rows = run_["timeline"]
    t = [row["t"] for row in rows]
    for name, style in (("limit", "C0"), ("running", "C2"), ("engine_running", "C7")):
        if any(name in row for row in rows):
            ax.plot(t, [row.get(name, math.nan) for row in rows], color=style, label=name)
    ax.axvline(run_["seconds"], color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("s from the first arrival (dotted: the last)", fontsize=8)
    ax.set_ylabel("requests", fontsize=8)
    ax.tick_params(labelsize=8)
    right = ax.twinx()
    right.bar(t, [row["in_time"] for row in rows], color="C1", alpha=0.5, label="in time /s")
    right.bar(t, [-row["late"] for row in rows], color="C3", alpha=0.5,
              label="admitted, not in time /s (down)")  # fmt: skip
    right.tick_params(labelsize=8)
    ax.set_title(f"{run_['mode']} admission at {run_['load']}x", fontsize=9)
    lines, labels = ax.get_legend_handles_labels()
    bars, bar_labels = right.get_legend_handles_labels()
    ax.legend(lines + bars, labels + bar_labels, fontsize=7, loc="upper right")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--mode", choices=sorted(WORKERS), default=StackOptions().mode, help="kvmesh up --mode"
    )
    parser.add_argument("--quick", action="store_true", help="fewer loads, shorter runs")
    parser.add_argument("--loads", type=float, nargs="+", default=None,
                        help="multiples of capacity (default 0.5 1 2 3 4, quick 1 3)")  # fmt: skip
    parser.add_argument("--seconds", type=int, default=None, help="per load (default 20, quick 10)")
    parser.add_argument("--goal-seconds", type=int, default=None, help=f"at {GOAL_LOAD}x (60, 20)")
    parser.add_argument(
        "--capacity-clients", type=int, default=64, help="the old gateway's --max-in-flight"
    )
    parser.add_argument("--capacity-seconds", type=int, default=None, help="default 30, quick 15")
    parser.add_argument("--capacity", type=float, default=None,
                        help="requests/s taken as the capacity, not measured")  # fmt: skip
    parser.add_argument("--warmup-seconds", type=int, default=10)
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="admissions to run, in this order at each load")  # fmt: skip
    parser.add_argument("--port-offset", type=int, default=PORT_OFFSET,
                        help="moves every port of the stack (kvmesh up --port-offset)")  # fmt: skip
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.loads is None:
        args.loads = [1.0, 3.0] if args.quick else [0.5, 1.0, 2.0, 3.0, 4.0]
    return with_quick_defaults(
        args, {"seconds": (20, 10), "goal_seconds": (60, 20), "capacity_seconds": (30, 15)}
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=120)
    report = asyncio.run(run(args, console))
    print_table(report, console)
    if not args.no_write:
        section = markdown(report, repeat_command("bench.overload", args, parse_args))
        console.print(publish("overload", report, section, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
