"""Engine benchmark: kvmesh's engine against transformers and the hardware, on SmolLM2-135M.

Not a test. Runs every comparison side by side in one process on this CPU, prints a table and
writes bench/results/engine.json and bench/results/engine.png:

  (a) offline throughput, 64 requests (prompts 64-512 tokens, 128 output tokens, ignore_eos):
      the kvmesh engine (continuous batching) vs transformers generate() in static batches of 8
      with padding. Goal: >= 3x output tokens/s.
  (b) batch-1 decode step time vs the memory-bandwidth floor (weight bytes read per step over
      the measured large-copy bandwidth). Goal: within 1.5x.
  (c) time to first token of a 1,024-token shared prefix + 32-token suffix, prefix cache on vs
      off. Goal: >= 5x lower with the cache.
  (d) int8 vs fp32: decode tokens/s at batch 1 and 32, and greedy agreement.

    .venv/bin/python -m bench.engine            # full run (several minutes on 2 cores)
    .venv/bin/python -m bench.engine --quick    # fewer requests and steps
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from transformers import LlamaForCausalLM

from bench.report import BENCHMARKS, RESULTS, write_results, write_section
from services.worker.engine.api import EngineRequest, SamplingParams
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.loader import LoadedModel, load_model, save_hf_folder

MODEL = "smollm2-135m"
# Enough KV for all 64 throughput requests at once (64 x 640 tokens ~ 1.9 GB in fp32).
THROUGHPUT_KV_BYTES = 3 << 30
AGREEMENT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain photosynthesis in one sentence.",
    "What is 17 times 3?",
    "Name a famous painting by Leonardo da Vinci.",
    "Give me a tip for learning to code.",
    "Why is the sky blue?",
]


@dataclass(slots=True)
class Workload:
    num_requests: int = 64
    min_prompt: int = 64
    max_prompt: int = 512
    output_tokens: int = 128
    hf_batch: int = 8
    decode_steps: int = 32
    prefix_tokens: int = 1024
    suffix_tokens: int = 32
    ttft_repeats: int = 3
    # (a) runs kvmesh and transformers alternately this many times and keeps each one's best.
    throughput_repeats: int = 2
    agreement_prompts: int = 8
    agreement_tokens: int = 32

    @classmethod
    def quick(cls) -> Workload:
        return cls(
            num_requests=16,
            decode_steps=12,
            ttft_repeats=2,
            throughput_repeats=1,
            agreement_prompts=4,
        )


@dataclass(slots=True)
class Row:
    """One comparison: kvmesh's figure beside its baseline."""

    name: str
    kvmesh: float
    baseline: float
    baseline_name: str
    unit: str
    ratio: float
    goal: str
    met: bool
    label: str = "kvmesh"  # what the kvmesh figure is (e.g. "cache on", "int8")
    miss: str = ""  # by how much a goal is missed


@dataclass(slots=True)
class Report:
    rows: list[Row] = field(default_factory=list)
    details: dict[str, float] = field(default_factory=dict)
    machine: dict[str, str] = field(default_factory=dict)


# ---- workloads ----------------------------------------------------------------------------


def random_prompts(count: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.randint(lo, hi) for _ in range(count)]
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def engine_for(loaded: LoadedModel, **overrides: object) -> Engine:
    config = EngineConfig(
        model=MODEL, kv_cache_bytes=1 << 30, max_num_batched_tokens=1024, max_num_seqs=64
    )
    return Engine(loaded, config.replace(**overrides))


def drain(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


# ---- measurements -------------------------------------------------------------------------


def copy_bandwidth() -> float:
    """Bytes per second moved (read + write) by a large tensor copy, best of 5."""
    src = torch.ones(64 << 20)  # 256 MiB of fp32
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() * src.element_size() / best


def weight_bytes(loaded: LoadedModel) -> int:
    """Bytes of the weights one decode step reads (tied embeddings counted once)."""
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in loaded.model.parameters()}
    return sum(unique.values())


def kvmesh_throughput(loaded: LoadedModel, prompts: list[list[int]], out_tokens: int) -> float:
    engine = engine_for(loaded, kv_cache_bytes=THROUGHPUT_KV_BYTES)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"a{i}", prompt, greedy(out_tokens)))
    start = time.perf_counter()
    produced = drain(engine)
    elapsed = time.perf_counter() - start
    return sum(len(t) for t in produced.values()) / elapsed


def hf_throughput(
    model: LlamaForCausalLM, prompts: list[list[int]], out_tokens: int, batch: int
) -> float:
    start = time.perf_counter()
    produced = 0
    for first in range(0, len(prompts), batch):
        produced += hf_generate_batch(model, prompts[first : first + batch], out_tokens)
    return produced / (time.perf_counter() - start)


def hf_generate_batch(model: LlamaForCausalLM, prompts: list[list[int]], out_tokens: int) -> int:
    """Static batch, left padding (token 0 masked out); returns output tokens produced."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=out_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return (out.shape[1] - width) * len(prompts)


def decode_step_s(loaded: LoadedModel, batch: int, steps: int, prompt_len: int = 64) -> float:
    """Best wall time of one engine step with `batch` requests all decoding."""
    engine = engine_for(loaded)
    prompts = random_prompts(batch, prompt_len, prompt_len, loaded.config.vocab_size, seed=5)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"d{i}", prompt, greedy(steps + 8)))
    while engine.scheduler.num_waiting or any(
        s.num_output_tokens == 0 for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()  # warm-up decode
    return min(_timed(engine.step) for _ in range(steps))


ATTENTION_OPS = ("aten::index_select", "scaled_dot_product", "kvmesh::paged_decode_attention")


def decode_step_breakdown(loaded: LoadedModel, prompts: list[list[int]]) -> dict[str, float]:
    """One engine step with every throughput request decoding, once per decode-attention path
    (the C kernel, and gathered blocks + SDPA): best wall times in ms, and for the kernel path
    the shares of its op time (torch profiler, one more step) spent in attention and in
    matmuls. Shares, unlike times, survive a busy machine."""
    engines = {}
    for mode in ("kernel", "sdpa"):
        engine = engine_for(
            loaded,
            kv_cache_bytes=THROUGHPUT_KV_BYTES,
            max_num_batched_tokens=4096,
            decode_attention=mode,
        )
        for i, prompt in enumerate(prompts):
            engine.add_request(EngineRequest(f"b{i}", prompt, greedy(16)))
        while engine.scheduler.num_waiting or any(
            s.num_output_tokens == 0 for s in engine.scheduler.running
        ):
            engine.step()
        engines[mode] = engine
    # Alternating, so that both paths see the same moments of a shared machine.
    times: dict[str, list[float]] = {mode: [] for mode in engines}
    for _ in range(5):
        for mode, engine in engines.items():
            times[mode].append(_timed(engine.step))
    del engines["sdpa"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engines["kernel"].step()
    self_us = {event.key: event.self_cpu_time_total for event in prof.key_averages()}
    total = sum(self_us.values())
    attention = sum(v for k, v in self_us.items() if any(op in k for op in ATTENTION_OPS))
    matmul = sum(v for k, v in self_us.items() if k in ("aten::mm", "aten::addmm", "aten::bmm"))
    return {
        "decode_all_step_ms": min(times["kernel"]) * 1e3,
        "decode_all_step_sdpa_ms": min(times["sdpa"]) * 1e3,
        "decode_all_attention_share": attention / total,
        "decode_all_matmul_share": matmul / total,
    }


def hf_decode_step_s(model: LlamaForCausalLM, steps: int, prompt_len: int = 64) -> float:
    """transformers' batch-1 per-token time: (generate n+1 tokens - generate 1) / n."""
    prompt = random_prompts(1, prompt_len, prompt_len, model.config.vocab_size, seed=5)
    hf_generate_batch(model, prompt, 2)  # warm-up
    one = min(_timed(lambda: hf_generate_batch(model, prompt, 1)) for _ in range(3))
    many = min(_timed(lambda: hf_generate_batch(model, prompt, steps + 1)) for _ in range(3))
    return (many - one) / steps


def ttft_s(loaded: LoadedModel, work: Workload, prefix_caching: bool) -> float:
    """Best time to first token of prefix + a fresh suffix, after one warm request."""
    engine = engine_for(loaded, enable_prefix_caching=prefix_caching, max_num_batched_tokens=2048)
    vocab = loaded.config.vocab_size
    (prefix,) = random_prompts(1, work.prefix_tokens, work.prefix_tokens, vocab, seed=11)
    suffixes = random_prompts(
        work.ttft_repeats + 1, work.suffix_tokens, work.suffix_tokens, vocab, 12
    )
    times = []
    for i, suffix in enumerate(suffixes):
        engine.add_request(EngineRequest(f"t{i}", prefix + suffix, greedy(1)))
        elapsed = _timed(lambda: drain(engine))
        if i:  # the first request only warms the cache (and the allocator)
            times.append(elapsed)
    return min(times)


def greedy_agreement(fp32: LoadedModel, int8: LoadedModel, work: Workload) -> tuple[float, float]:
    """(share of prompts with identical output, mean share of the output before divergence)
    over chat prompts, greedy."""
    tokenizer = fp32.tokenizer
    questions = AGREEMENT_QUESTIONS[: work.agreement_prompts]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    outputs = []
    for loaded in (fp32, int8):
        engine = engine_for(loaded)
        for i, prompt in enumerate(prompts):
            sampling = SamplingParams(max_tokens=work.agreement_tokens)
            engine.add_request(EngineRequest(f"g{i}", prompt, sampling))
        produced = drain(engine)
        outputs.append([produced[f"g{i}"] for i in range(len(prompts))])
    identical = sum(a == b for a, b in zip(*outputs, strict=True)) / len(prompts)
    prefix = [_common_prefix(a, b) / max(len(a), len(b)) for a, b in zip(*outputs, strict=True)]
    return identical, statistics.mean(prefix)


# ---- report -------------------------------------------------------------------------------


def run(work: Workload, threads: int, progress: Progress) -> Report:
    torch.set_num_threads(threads)
    report = Report()
    stages = progress.add_task("loading", total=8 + 2 * work.throughput_repeats)

    def stage(name: str) -> None:
        progress.update(stages, description=name, advance=1)

    # Measured twice (here and at (b)), keeping the better: a busy moment only lowers it.
    bandwidth = copy_bandwidth()
    loaded = load_model(MODEL)
    vocab = loaded.config.vocab_size
    hf = hf_model(loaded)
    prompts = random_prompts(work.num_requests, work.min_prompt, work.max_prompt, vocab, seed=1)
    ours = theirs = 0.0
    for attempt in range(1, work.throughput_repeats + 1):
        stage(f"(a) kvmesh offline throughput, run {attempt}")
        ours = max(ours, kvmesh_throughput(loaded, prompts, work.output_tokens))
        stage(f"(a) transformers static batches, run {attempt}")
        theirs = max(theirs, hf_throughput(hf, prompts, work.output_tokens, work.hf_batch))
    report.rows.append(
        _goal_row(
            "(a) offline throughput",
            ours,
            theirs,
            "transformers bs=8",
            "tok/s",
            ours / theirs,
            ">= 3x",
            3.0,
            at_least=True,
        )
    )
    stage("(a) where a decode step of all requests goes")
    report.details |= decode_step_breakdown(loaded, prompts)
    report.details |= {
        "prompt_tokens": sum(map(len, prompts)),
        "prompt_tokens_padded_by_transformers": sum(
            max(map(len, prompts[i : i + work.hf_batch])) * len(prompts[i : i + work.hf_batch])
            for i in range(0, len(prompts), work.hf_batch)
        ),
    }

    stage("(b) bandwidth and batch-1 decode")
    bandwidth = max(bandwidth, copy_bandwidth())
    floor = weight_bytes(loaded) / bandwidth
    step = decode_step_s(loaded, 1, work.decode_steps)
    hf_step = hf_decode_step_s(hf, work.decode_steps)
    report.rows.append(
        _goal_row(
            "(b) batch-1 decode step",
            step * 1e3,
            floor * 1e3,
            "bandwidth floor",
            "ms",
            step / floor,
            "<= 1.5x floor",
            1.5,
            at_least=False,
        )
    )
    report.details |= {
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes": weight_bytes(loaded),
        "transformers_batch1_step_ms": hf_step * 1e3,
    }

    stage("(c) TTFT, prefix cache off")
    off = ttft_s(loaded, work, prefix_caching=False)
    stage("(c) TTFT, prefix cache on")
    on = ttft_s(loaded, work, prefix_caching=True)
    report.rows.append(
        _goal_row(
            "(c) TTFT 1024+32, cache on",
            on * 1e3,
            off * 1e3,
            "cache off",
            "ms",
            off / on,
            ">= 5x lower",
            5.0,
            at_least=True,
            label="cache on",
        )
    )

    stage("(d) fp32 decode batch 32")
    fp32_32 = 32 / decode_step_s(loaded, 32, work.decode_steps)
    stage("(d) int8 decode")
    del hf
    int8 = load_model(MODEL, quantization="int8")
    int8_1 = 1 / decode_step_s(int8, 1, work.decode_steps)
    int8_32 = 32 / decode_step_s(int8, 32, work.decode_steps)
    stage("(d) greedy agreement")
    identical, prefix_share = greedy_agreement(loaded, int8, work)
    report.rows += [
        _int8_row("(d) int8 decode, batch 1", int8_1, 1 / step, "tok/s"),
        _int8_row("(d) int8 decode, batch 32", int8_32, fp32_32, "tok/s"),
        _int8_row("(d) int8 greedy agreement", prefix_share * 100, 100.0, "% tokens"),
    ]
    report.details |= {"int8_identical_outputs_share": identical}
    stage("done")
    return report


def hf_model(loaded: LoadedModel) -> LlamaForCausalLM:
    """transformers' Llama on exactly the weights the engine loaded (from the GGUF)."""
    with tempfile.TemporaryDirectory() as folder:
        save_hf_folder(loaded, Path(folder))
        model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    return model


def print_table(report: Report, console: Console) -> None:
    table = Table(title="kvmesh engine, SmolLM2-135M fp32 on CPU")
    for column in ("comparison", "kvmesh", "baseline", "unit", "ratio", "goal", "met"):
        table.add_column(column)
    for row in report.rows:
        table.add_row(
            row.name,
            f"{row.kvmesh:.1f}",
            f"{row.baseline:.1f} ({row.baseline_name})",
            row.unit,
            f"{row.ratio:.2f}x",
            row.goal,
            "yes" if row.met else f"NO ({row.miss})",
        )
    console.print(table)
    for key, value in report.details.items():
        console.print(f"  {key}: {value:.3f}" if isinstance(value, float) else f"  {key}: {value}")


def markdown_section(report: Report, work: Workload, elapsed_s: float) -> str:
    """The "## Engine" section of BENCHMARKS.md, from this run's figures."""
    d, m = report.details, report.machine
    lines = [
        "## Engine",
        "",
        f"`{m['command']}` — SmolLM2-135M-"
        f"Instruct from its GGUF, fp32, on this CPU ({m['cpu']}, {os.cpu_count()} cores, "
        f"{d['threads']:.0f} torch threads), shared with other work (load average "
        f"{d['load_average_before']:.1f} at the start, {d['load_average_after']:.1f} at the end; "
        f"{elapsed_s / 60:.0f} min). transformers runs on exactly the weights the engine loaded. "
        "Step and TTFT figures are the best of their repeats and (a) the better of "
        f"{work.throughput_repeats} alternating run(s) per side: on a shared CPU single samples "
        "swing by 2x. Results: `bench/results/engine.json`, `bench/results/engine.png`.",
        "",
        "| comparison | kvmesh | baseline | ratio | goal |",
        "|---|---|---|---|---|",
    ]
    for row in report.rows:
        verdict = (
            "report"
            if row.goal == "report"
            else f"{row.goal}: " + ("met" if row.met else "**not met**")
        )
        lines.append(
            f"| {row.name} | {row.kvmesh:.1f} {row.unit} ({row.label}) | {row.baseline:.1f} "
            f"{row.unit} ({row.baseline_name}) | {row.ratio:.2f}x | {verdict} |"
        )
    lines += [
        "",
        f"Workload (a): {work.num_requests} requests, prompts {work.min_prompt}-"
        f"{work.max_prompt} tokens ({d['prompt_tokens']:.0f} in all; transformers' batches of "
        f"{work.hf_batch} pad them to {d['prompt_tokens_padded_by_transformers']:.0f}), "
        f"{work.output_tokens} output tokens each, EOS ignored. A decode step of all "
        f"{work.num_requests} requests takes {d['decode_all_step_ms']:.0f} ms with the C "
        f"paged decode-attention kernel vs {d['decode_all_step_sdpa_ms']:.0f} ms with gathered "
        f"blocks + SDPA (same run, alternating); with the kernel, attention is "
        f"{d['decode_all_attention_share']:.0%} of the step's op time, the projections' "
        f"matmuls {d['decode_all_matmul_share']:.0%}.",
        f"(b): floor = {d['weight_bytes'] / 1e6:.0f} MB of weights / "
        f"{d['copy_bandwidth_gb_s']:.1f} GB/s copy bandwidth; transformers' own batch-1 step: "
        f"{d['transformers_batch1_step_ms']:.1f} ms.",
        f"(d): int8 agreement over {work.agreement_prompts} chat prompts, "
        f"{work.agreement_tokens} greedy tokens: the share of tokens before the first "
        f"divergence; {d['int8_identical_outputs_share']:.0%} of the outputs are identical.",
        "",
    ]
    return "\n".join(lines)


def plot(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 3
    rows = -(-len(report.rows) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 3.4 * rows), squeeze=False)
    for ax, row in zip(axes.flat, report.rows, strict=False):
        ax.bar([row.label, row.baseline_name], [row.kvmesh, row.baseline], color=["C0", "C7"])
        ax.set_title(f"{row.name}\n{row.ratio:.2f}x ({row.goal})", fontsize=8)
        ax.set_ylabel(row.unit, fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in axes.flat[len(report.rows) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and steps")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    work = Workload.quick() if args.quick else Workload()
    console = Console(width=150)
    load_before = os.getloadavg()
    started = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        report = run(work, args.threads, progress)
    report.details |= {
        "threads": args.threads,
        "load_average_before": load_before[0],
        "load_average_after": os.getloadavg()[0],
    }
    report.machine |= {
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "command": "python -m bench.engine" + (" --quick" if args.quick else ""),
    }
    print_table(report, console)
    payload = {"workload": asdict(work), "rows": [asdict(r) for r in report.rows]}
    payload["details"] = report.details
    payload["machine"] = report.machine
    results = write_results("engine", payload, args.out)
    plot(report, args.out / "engine.png")
    write_section(markdown_section(report, work, time.perf_counter() - started))
    console.print(
        f"wrote {results}, {args.out / 'engine.png'} and the Engine section of {BENCHMARKS}"
    )


def _goal_row(
    name: str,
    kvmesh: float,
    baseline: float,
    baseline_name: str,
    unit: str,
    ratio: float,
    goal: str,
    bound: float,
    *,
    at_least: bool,
    label: str = "kvmesh",
) -> Row:
    met = ratio >= bound if at_least else ratio <= bound
    miss = ""
    if not met:
        miss = f"{1 - ratio / bound:.0%} short" if at_least else f"{ratio / bound - 1:.0%} over"
    return Row(name, kvmesh, baseline, baseline_name, unit, ratio, goal, met, label, miss)


def _int8_row(name: str, int8: float, fp32: float, unit: str) -> Row:
    return Row(name, int8, fp32, "fp32", unit, int8 / fp32, "report", True, label="int8")


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


if __name__ == "__main__":
    main()
