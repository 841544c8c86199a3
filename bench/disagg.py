"""Disaggregation benchmark: colocated on 2 workers vs 1 prefill + 1 decode worker.

    python -m bench.disagg [--model smollm2-135m] [--duration-s 90] [--no-write]

Not a test. For each mode it starts two workers, each pinned with `taskset` to its own core
(one torch thread each), and a router, then runs a mixed load against the router:
- chat: `--chat-clients` closed-loop clients, short prompts and long outputs (the running
  decodes whose inter-token latency suffers when a long prefill shares their worker);
- long: 1,000-token prompts (short outputs) arriving as a Poisson process among them.
Prompts are distinct random words, so no prefix cache helps.

Before the load, `--quiet-long` long prompts run one at a time on the idle mesh (their TTFT,
and split, the hand-off without contention). Reported per mode under the load: decode
inter-token latency (ITL, the gap between token-carrying chunks of the chat requests) p50/p99,
TTFT p50/p99 of both classes, goodput (requests/s meeting the TTFT and TPOT SLO), and, split,
the KV hand-off (the decode worker's Decode start to its import committed) as a share of the
long requests' TTFT, and the pull rate (bytes received over the time the pulls took). Goal: p99
ITL at least 2x lower split; KV transfer under 10 % of TTFT.

Then the cost of routing down: greedy outputs of the int8 tier against the full tier on a fixed
set of short prompts (the ones "auto" sends to the cheap tier), offline, as exact-match rate and
the mean share of tokens produced before the first divergence.

Writes bench/results/disagg.json and the "Disaggregation" section of BENCHMARKS.md (other
sections are kept).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench.mesh import metric
from bench.report import BENCHMARKS, write_results, write_section
from kvmesh.bench_report import RequestResult, Slo, distribution, percentile, summarize
from kvmesh.channels import insecure_channel
from kvmesh.grpc_server import READY_PREFIX
from kvmesh.loadgen import WORDS
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

HEADING = "## Disaggregation"
TIER = "bench"
MODES = ("colocated", "disaggregated")
ITL_GOAL_RATIO = 2.0
KV_SHARE_GOAL = 0.10


@dataclass
class Process:
    """A service started by the benchmark, with its output drained in the background."""

    name: str
    process: asyncio.subprocess.Process
    address: str
    metrics_port: int | None
    output: list[str] = field(default_factory=list)
    drain: asyncio.Task[None] | None = None

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 20)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        if self.drain is not None:
            await self.drain

    def metric(self, name: str, labels: str = "") -> float:
        """One sample from its Prometheus endpoint (0 when absent)."""
        assert self.metrics_port is not None, f"{self.name} serves no metrics"
        return metric(self.metrics_port, name, labels)


async def start(name: str, module: str, args: Sequence[str], core: int | None) -> Process:
    """Starts `python -m module args` (pinned to `core` when given) and waits until ready."""
    pin = ["taskset", "-c", str(core)] if core is not None else []
    process = await asyncio.create_subprocess_exec(
        *pin,
        sys.executable,
        "-m",
        module,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    assert process.stdout is not None
    output: list[str] = []
    while True:
        raw = await process.stdout.readline()
        if not raw:
            raise RuntimeError(f"{name} exited before it was ready:\n" + "".join(output[-30:]))
        line = raw.decode(errors="replace")
        output.append(line)
        if line.startswith(READY_PREFIX):
            info = json.loads(line[len(READY_PREFIX) :])
            break
    metrics = info.get("metrics_port")
    started = Process(
        name, process, str(info["address"]), None if metrics is None else int(metrics), output
    )

    async def drain() -> None:
        assert process.stdout is not None
        async for raw_line in process.stdout:
            output.append(raw_line.decode(errors="replace"))

    started.drain = asyncio.create_task(drain())
    return started


@dataclass(slots=True)
class Mesh:
    """The processes of one mode, in start order (stopped in reverse, even half-started)."""

    processes: list[Process] = field(default_factory=list)

    @property
    def workers(self) -> list[Process]:
        return self.processes[:2]

    @property
    def router(self) -> Process:
        return self.processes[2]

    async def stop(self) -> None:
        for process in reversed(self.processes):
            with contextlib.suppress(ProcessLookupError):
                await process.stop()


async def start_mesh(mode: str, args: argparse.Namespace, state: Path, mesh: Mesh) -> None:
    """Two workers pinned to cores 0 and 1, and the router over them, into `mesh`."""
    roles = ["colocated", "colocated"] if mode == "colocated" else ["prefill", "decode"]
    common = [
        "--model",
        args.model,
        "--tier",
        TIER,
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--num-threads",
        str(args.threads),
        "--kv-cache-bytes",
        str(args.kv_cache_mb << 20),
        "--max-num-batched-tokens",
        str(args.max_batched_tokens),
    ]
    for core, role in enumerate(roles):
        worker_args = ["--role", role, *common]
        mesh.processes.append(await start(f"{role}-{core}", "services.worker", worker_args, core))
    workers = mesh.workers
    pools: dict[str, Any] = {"name": TIER}
    if mode == "colocated":
        pools["colocated"] = [w.address for w in workers]
    else:
        pools["prefill"], pools["decode"] = [workers[0].address], [workers[1].address]
    path = state / f"pools-{mode}.yaml"
    path.write_text(yaml.safe_dump({"tiers": [pools]}))
    router_args = ["--config", str(path), "--port", "0", "--metrics-port", "-1"]
    mesh.processes.append(await start("router", "services.router", router_args, args.router_core))


@dataclass(slots=True)
class Measured:
    """One request of the run, with its class and the KV transfer time it reported."""

    kind: str
    result: RequestResult
    kv_transfer_ms: float = 0.0


async def measure(
    stub: router_pb2_grpc.RouterStub, kind: str, request: common_pb2.InferenceRequest, zero: float
) -> Measured:
    """Sends one request to the router and times its stream (TTFT, chunk gaps, e2e)."""
    measured = Measured(kind, RequestResult(ok=False, start_s=time.perf_counter() - zero))
    result = measured.result
    sent = last = time.perf_counter()
    call = stub.Generate()
    try:
        await call.write(router_pb2.RouteMessage(request=request))
        await call.done_writing()
        async for event in call:
            now = time.perf_counter()
            if event.WhichOneof("event") == "chunk" and event.chunk.token_ids:
                if result.output_tokens == 0:
                    result.ttft_s = now - sent
                else:
                    result.itl_s.append(now - last)
                last = now
                result.output_tokens += len(event.chunk.token_ids)
            elif event.WhichOneof("event") == "finished":
                finished = event.finished
                result.prompt_tokens = finished.usage.prompt_tokens
                result.finish_reason = common_pb2.FinishReason.Name(finished.finish_reason)
                result.ok = finished.finish_reason != common_pb2.FINISH_REASON_ERROR
                result.error = finished.error_message
                measured.kv_transfer_ms = finished.timings.kv_transfer_ms
        result.e2e_s = time.perf_counter() - sent
    except grpc.aio.AioRpcError as error:
        result.error = f"{error.code().name}: {error.details()}"
    return measured


@dataclass(slots=True)
class Prompts:
    """Distinct prompts of exact token lengths, from the model's own tokenizer."""

    model: str
    seed: int
    _rng: random.Random = field(init=False)
    _tokenizer: Any = field(init=False)

    def __post_init__(self) -> None:
        from kvmesh.contracts.tokenizer import Tokenizer

        self._rng = random.Random(self.seed)
        self._tokenizer = Tokenizer.from_model_path(self.model)

    def make(self, num_tokens: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < num_tokens:
            words = " ".join(self._rng.choice(WORDS) for _ in range(num_tokens))
            ids.extend(self._tokenizer.encode(words + "."))
        return ids[:num_tokens]


def _request(request_id: str, prompt: list[int], max_tokens: int) -> common_pb2.InferenceRequest:
    return common_pb2.InferenceRequest(
        request_id=request_id,
        model=TIER,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


async def warm_up(
    stub: router_pb2_grpc.RouterStub, args: argparse.Namespace, prompts: Prompts
) -> None:
    """Both workers see one long and one chat request before anything is measured."""
    zero = time.perf_counter()
    for index in range(2):
        long = _request(f"warm-l{index}", prompts.make(args.long_prompt), 2)
        await measure(stub, "warm", long, zero)
        await measure(
            stub, "warm", _request(f"warm-c{index}", prompts.make(args.chat_prompt), 4), zero
        )


async def run_quiet(
    stub: router_pb2_grpc.RouterStub, args: argparse.Namespace, prompts: Prompts
) -> list[Measured]:
    """Long prompts one at a time on an idle mesh: TTFT and the hand-off without contention."""
    zero = time.perf_counter()
    return [
        await measure(
            stub, "quiet", _request(f"quiet-{i}", prompts.make(args.long_prompt), 2), zero
        )
        for i in range(args.quiet_long)
    ]


async def run_mixed(
    stub: router_pb2_grpc.RouterStub, args: argparse.Namespace, prompts: Prompts
) -> list[Measured]:
    """Chat clients in closed loops and long prompts on a Poisson schedule, for the duration."""
    results: list[Measured] = []
    counter = iter(range(10**9))
    zero = time.perf_counter()
    end = zero + args.duration_s

    async def chat_client() -> None:
        while time.perf_counter() < end:
            request = _request(
                f"chat-{next(counter)}", prompts.make(args.chat_prompt), args.chat_output
            )
            results.append(await measure(stub, "chat", request, zero))

    async def long_arrivals() -> None:
        rng = random.Random(args.seed)
        pending = []
        while True:
            await asyncio.sleep(rng.expovariate(args.long_rate))
            if time.perf_counter() >= end:
                break
            request = _request(
                f"long-{next(counter)}", prompts.make(args.long_prompt), args.long_output
            )
            pending.append(asyncio.create_task(measure(stub, "long", request, zero)))
        results.extend(await asyncio.gather(*pending))

    await asyncio.gather(long_arrivals(), *(chat_client() for _ in range(args.chat_clients)))
    return results


@dataclass(slots=True, frozen=True)
class KvCounters:
    """The decode worker's KV counters at one moment."""

    bytes: float
    pull_seconds: float

    @classmethod
    def read(cls, decode: Process) -> KvCounters:
        return cls(
            decode.metric("kvmesh:kv_transfer_bytes_total", 'direction="received"'),
            decode.metric("kvmesh:kv_transfer_seconds_sum"),
        )


def _handoff_shares(measured: list[Measured], kind: str) -> dict[str, float]:
    """Hand-off time (the decode worker's Decode start to its import committed: allocation,
    pull, writes) over the client's TTFT, for the requests of one kind."""
    shares = [
        m.kv_transfer_ms / (m.result.ttft_s * 1000)
        for m in measured
        if m.kind == kind and m.result.ok and m.result.ttft_s > 0
    ]
    return {
        "mean_share": sum(shares) / len(shares) if shares else math.nan,
        "p50_share": percentile(shares, 50),
        "max_share": max(shares, default=math.nan),
        "mean_ms": sum(m.kv_transfer_ms for m in measured if m.kind == kind)
        / max(1, sum(m.kind == kind for m in measured)),
    }


def mode_report(
    mode: str,
    quiet: list[Measured],
    mixed: list[Measured],
    duration_s: float,
    slo: Slo,
    kv: tuple[KvCounters, KvCounters] | None,
) -> dict[str, Any]:
    """Figures of one mode; KV transfer only when split (`kv`: counters before/after the mix)."""
    report: dict[str, Any] = {
        "mode": mode,
        "quiet_long_ttft": distribution([m.result.ttft_s for m in quiet if m.result.ok]),
        "all": summarize([m.result for m in mixed], duration_s, slo),
        "chat": summarize([m.result for m in mixed if m.kind == "chat"], duration_s, slo),
        "long": summarize([m.result for m in mixed if m.kind == "long"], duration_s, slo),
    }
    if kv is not None:
        before, after = kv
        moved = after.bytes - before.bytes
        seconds = after.pull_seconds - before.pull_seconds
        report["kv"] = {
            "bytes": moved,
            "pull_seconds": seconds,
            "mb_per_s": moved / seconds / 1e6 if seconds else math.nan,
            "loaded": _handoff_shares(mixed, "long"),
            "quiet": _handoff_shares(quiet, "quiet"),
        }
    return report


def agreement(args: argparse.Namespace) -> dict[str, Any]:
    """Greedy int8 vs full outputs on fixed short prompts: the measured cost of routing down."""
    from services.worker.engine.api import SamplingParams
    from services.worker.engine.llm import LLM

    prompts = Prompts(args.model, seed=12345)
    batch = [prompts.make(args.agreement_prompt_tokens) for _ in range(args.agreement_prompts)]
    sampling = SamplingParams(max_tokens=args.agreement_output, ignore_eos=True)
    outputs = {}
    for quantization in ("none", "int8"):
        llm = LLM(args.model, quantization=quantization, num_threads=args.threads)
        outputs[quantization] = [c.token_ids for c in llm.generate(batch, sampling)]
        del llm
    exact = 0
    shared_share = []
    for full, cheap in zip(outputs["none"], outputs["int8"], strict=True):
        exact += full == cheap
        same = next((i for i, (a, b) in enumerate(zip(full, cheap, strict=True)) if a != b), None)
        shared_share.append((len(full) if same is None else same) / len(full))
    return {
        "prompts": len(batch),
        "prompt_tokens": args.agreement_prompt_tokens,
        "output_tokens": args.agreement_output,
        "exact_match_rate": exact / len(batch),
        "mean_shared_prefix": sum(shared_share) / len(shared_share),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    slo = Slo(ttft_s=args.slo_ttft_s, tpot_s=args.slo_tpot_ms / 1000)
    prompts = Prompts(args.model, args.seed)
    modes = []
    state = Path(tempfile.mkdtemp(prefix="kvmesh-bench-"))
    try:
        for mode in args.modes:
            print(f"{mode}: starting workers and router", flush=True)
            mesh = Mesh()
            try:
                await start_mesh(mode, args, state, mesh)
                decode = mesh.workers[1] if mode == "disaggregated" else None
                async with insecure_channel(mesh.router.address) as channel:
                    stub = router_pb2_grpc.RouterStub(channel)
                    await warm_up(stub, args, prompts)
                    quiet = await run_quiet(stub, args, prompts)
                    before = KvCounters.read(decode) if decode is not None else None
                    started = time.perf_counter()
                    mixed = await run_mixed(stub, args, prompts)
                    duration = time.perf_counter() - started
                kv = None
                if decode is not None and before is not None:
                    kv = (before, KvCounters.read(decode))
                modes.append(mode_report(mode, quiet, mixed, duration, slo, kv))
                print(json.dumps(modes[-1]["chat"]["itl"]), flush=True)
            finally:
                await mesh.stop()
    finally:
        shutil.rmtree(state, ignore_errors=True)
    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "args": vars(args),
        "slo": asdict(slo),
        "modes": modes,
    }
    if not args.skip_agreement:
        print("agreement: int8 vs full, offline", flush=True)
        report["agreement"] = agreement(args)
    return report


def markdown(report: dict[str, Any]) -> str:
    """The Disaggregation section of BENCHMARKS.md."""
    args = report["args"]
    by_mode = {m["mode"]: m for m in report["modes"]}
    lines = [
        HEADING,
        "",
        f"`python -m bench.disagg` — model `{args['model']}` on CPU ({report['machine']}); "
        f"each worker pinned with taskset to its own core, {args['threads']} torch thread; "
        f"{args['duration_s']:.0f} s per mode. Load: {args['chat_clients']} closed-loop chat "
        f"clients ({args['chat_prompt']}-token prompts, {args['chat_output']} output tokens) "
        f"and {args['long_prompt']}-token prompts ({args['long_output']} output tokens) arriving "
        f"as a Poisson process at {args['long_rate']}/s. SLO for goodput: TTFT <= "
        f"{args['slo_ttft_s']} s and TPOT <= {args['slo_tpot_ms']} ms. ITL is the gap between "
        "token-carrying chunks of the chat requests (the running decodes).",
        "",
        "| mode | chat ITL p50 ms | chat ITL p99 ms | chat TTFT p50 / p99 ms "
        "| long TTFT p50 / p99 ms | completed | goodput req/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in report["modes"]:
        chat, long = mode["chat"], mode["long"]
        lines.append(
            f"| {mode['mode']} | {chat['itl']['p50_ms']:.0f} | {chat['itl']['p99_ms']:.0f} "
            f"| {chat['ttft']['p50_ms']:.0f} / {chat['ttft']['p99_ms']:.0f} "
            f"| {long['ttft']['p50_ms']:.0f} / {long['ttft']['p99_ms']:.0f} "
            f"| {mode['all']['completed']} | {mode['all']['goodput']:.3f} |"
        )
    lines.append("")
    alone = ", ".join(
        f"{m['mode']} {m['quiet_long_ttft']['mean_ms']:.0f} ms" for m in report["modes"]
    )
    lines.append(f"A {args['long_prompt']}-token prompt alone on the idle mesh, TTFT: {alone}.")
    if set(MODES) <= set(by_mode):
        colocated = by_mode["colocated"]["chat"]["itl"]["p99_ms"]
        split = by_mode["disaggregated"]["chat"]["itl"]["p99_ms"]
        ratio = colocated / split if split else math.nan
        verdict = "met" if ratio >= ITL_GOAL_RATIO else "not met"
        lines.append(
            f"p99 ITL colocated / disaggregated: {ratio:.2f}x (goal >= {ITL_GOAL_RATIO:.0f}x: "
            f"{verdict})."
        )
    kv = by_mode.get("disaggregated", {}).get("kv")
    if kv:
        loaded, quiet = kv["loaded"], kv["quiet"]
        verdict = "met" if loaded["mean_share"] < KV_SHARE_GOAL else "not met"
        quiet_ttft = by_mode["disaggregated"]["quiet_long_ttft"]["mean_ms"]
        lines.append(
            f"KV hand-off (split; Decode start to import committed, over the long prompts' "
            f"TTFT): under the mixed load mean {loaded['mean_share']:.1%}, p50 "
            f"{loaded['p50_share']:.1%} ({loaded['mean_ms']:.0f} ms; goal < 10 %: {verdict}); "
            f"on an idle mesh {quiet['mean_share']:.1%} ({quiet['mean_ms']:.0f} ms of "
            f"{quiet_ttft:.0f} ms TTFT, {args['quiet_long']} prompts). Pulls under load moved "
            f"{kv['bytes'] / 1e6:.0f} MB in {kv['pull_seconds']:.1f} s: {kv['mb_per_s']:.0f} MB/s."
        )
    agreed = report.get("agreement")
    if agreed:
        lines.append(
            f"Cost of routing down (int8 tier vs full tier, greedy, {agreed['prompts']} fixed "
            f"{agreed['prompt_tokens']}-token prompts, {agreed['output_tokens']} tokens each): "
            f"{agreed['exact_match_rate']:.0%} of answers identical; on average the first "
            f"{agreed['mean_shared_prefix']:.0%} of each answer agrees before the first "
            "divergence."
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--duration-s", type=float, default=90.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--router-core", type=int, default=None, help="pin the router too")
    parser.add_argument("--kv-cache-mb", type=int, default=1024)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument("--chat-clients", type=int, default=4)
    parser.add_argument("--chat-prompt", type=int, default=32)
    parser.add_argument("--chat-output", type=int, default=64)
    parser.add_argument("--long-prompt", type=int, default=1000)
    parser.add_argument("--long-output", type=int, default=8)
    parser.add_argument("--long-rate", type=float, default=0.15, help="long prompts per second")
    parser.add_argument("--quiet-long", type=int, default=3, help="long prompts on an idle mesh")
    parser.add_argument("--slo-ttft-s", type=float, default=15.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=300.0)
    parser.add_argument("--agreement-prompts", type=int, default=32)
    parser.add_argument("--agreement-prompt-tokens", type=int, default=24)
    parser.add_argument("--agreement-output", type=int, default=32)
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print only")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    section = markdown(report)
    print(section)
    if not args.no_write:
        results = write_results("disagg", report)
        write_section(section)
        print(f"wrote {results} and the {HEADING!r} section of {BENCHMARKS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
