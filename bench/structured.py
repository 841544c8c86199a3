"""Structured-output benchmark (issue 16): what a JSON-Schema constraint costs the engine.

Not a test. On the default model (SmolLM2-135M), in one process on this CPU, per grammar
backend (xgrammar, the default, and llguidance):

  (a) 64 concurrent requests, half of them under a JSON Schema of moderate size (nested
      object, enums, ranges, a pattern, an array with an item count), against all 64
      unconstrained, the two batches alternating for --rounds rounds: output tokens/s of each
      (goal: mixed >= 0.95x unconstrained). The free requests run to max_tokens (ignore_eos);
      the constrained ones stop when their JSON is complete.
  (b) the time the step spends filling and applying the token bitmask (engine.grammars
      .mask_logits), per step with constrained rows, p50/p99, and its share of the step;
  (c) compile time of a schema, cold (a schema the engine has not seen) and cached, p50/p99;
  (d) the share of answers that parse (strict JSON) and validate, on the same 32 prompts
      greedy with and without the constraint (without: stopping at EOS).

    flock -x /tmp/kvmesh-cpu.lock .venv/bin/python -m bench.structured          # ~5 min
    .venv/bin/python -m bench.structured --quick                                 # short run

Writes bench/results/structured.json, bench/results/structured.png and the "Structured
output" section of BENCHMARKS.md; each timed region records the load average and the cores
other processes used meanwhile (bench.peers.timed_region).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.peers import Region, machine, timed_region
from bench.report import (
    BENCHMARKS,
    RESULTS,
    repeat_command,
    save_figure,
    with_quick_defaults,
    write_results,
    write_section,
)
from kvmesh.contracts.constraints import Constraint, ConstraintKind
from services.worker.engine.api import EngineRequest, SamplingParams
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.loader import LoadedModel, load_model

MODEL = "smollm2-135m"
BACKENDS = ("xgrammar", "llguidance")
CONCURRENCY = 64
WARM_UP_TOKENS = 32
"""Output tokens per request of the untimed warm-up batch."""
RATIO_GOAL = 0.95
"""Mixed over free output tok/s."""
"""Output tokens per request of the untimed warm-up batch."""
NAMES = ["Ada", "Bo", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana"]
CITIES = ["Oslo", "Lima", "Kyiv", "Pune", "Rome", "Cork", "Nara", "Baku"]

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {"enum": ["new", "vip", "late", "remote"]},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "role", "active", "score", "address", "tags"],
    "additionalProperties": False,
}
"""Moderate size: seven fields, a nested object, enums, ranges, a pattern, an array."""


@dataclass(slots=True)
class BackendFigures:
    """What one grammar backend measured."""

    free_tok_s: list[float] = field(default_factory=list)
    """Output tokens/s of all 64 unconstrained, per round."""
    mixed_tok_s: list[float] = field(default_factory=list)
    """Output tokens/s of 32 constrained + 32 unconstrained, per round."""
    mask_ms: list[float] = field(default_factory=list)
    """mask_logits time of each step with constrained rows (ms)."""
    step_ms: list[float] = field(default_factory=list)
    """Wall time of those steps (ms)."""
    compile_cold_ms: list[float] = field(default_factory=list)
    compile_cached_ms: list[float] = field(default_factory=list)
    valid_with: float = 0.0
    """Share of constrained answers that parse strictly and validate."""
    valid_without: float = 0.0
    """The same prompts unconstrained."""
    constrained_finish: dict[str, int] = field(default_factory=dict)
    regions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return statistics.median(self.mixed_tok_s) / statistics.median(self.free_tok_s)


def prompts(loaded: LoadedModel, count: int) -> list[list[int]]:
    """Chat prompts asking for a person record as JSON, each with its own details."""
    rendered = []
    for i in range(count):
        ask = (
            f"Write a JSON record for {NAMES[i % 8]} (user {i}) from {CITIES[(i // 8) % 8]}: "
            "name, age, role (admin/editor/viewer), active, score 0-1, address {city, zip of "
            "5 digits} and 1-3 tags (new, vip, late, remote). Answer with the JSON only."
        )
        messages = [{"role": "user", "content": ask}]
        rendered.append(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return rendered


def engine_for(loaded: LoadedModel, backend: str) -> Engine:
    config = EngineConfig(
        model=MODEL,
        kv_cache_bytes=1 << 30,
        max_num_batched_tokens=1024,
        max_num_seqs=CONCURRENCY,
        grammar_backend=backend,
    )
    return Engine(loaded, config)


def schema_constraint(schema: dict[str, Any]) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


@dataclass(slots=True)
class Run:
    """One batch run: tokens per request, their texts, finish reasons, the timed region."""

    tokens: dict[str, list[int]]
    texts: dict[str, str]
    finishes: dict[str, str]
    region: Region


def run_batch(
    engine: Engine,
    batch: list[EngineRequest],
    on_step: Callable[[float], None] | None = None,
) -> Run:
    """All requests at once, stepped until done, inside one timed region."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in batch}
    texts = dict.fromkeys(tokens, "")
    finishes: dict[str, str] = {}
    for request in batch:  # compiles are cached before: adding blocks on none
        engine.add_request(request)
    with timed_region() as region:
        while engine.has_work():
            started = time.perf_counter()
            outputs = engine.step()
            if on_step is not None:
                on_step(time.perf_counter() - started)
            for out in outputs:
                tokens[out.request_id].extend(out.new_token_ids)
                texts[out.request_id] += out.text_delta
                if out.finish_reason is not None:
                    finishes[out.request_id] = out.finish_reason.value
    return Run(tokens, texts, finishes, region)


def timed_mask(engine: Engine, figures: BackendFigures) -> Callable[[float], None]:
    """Wraps engine.grammars.mask_logits with a timer; returns the per-step hook that pairs
    each step's wall time with the mask time it contained."""
    mask_logits = engine.grammars.mask_logits
    pending: list[float] = []

    def timed(logits: torch.Tensor, matchers: Sequence[Any]) -> None:
        started = time.perf_counter()
        mask_logits(logits, matchers)
        if any(m is not None for m in matchers):
            pending.append(time.perf_counter() - started)

    def on_step(step_s: float) -> None:
        if pending:
            figures.mask_ms.append(sum(pending) * 1e3)
            figures.step_ms.append(step_s * 1e3)
            pending.clear()

    engine.grammars.mask_logits = timed  # type: ignore[method-assign]
    return on_step


def measure_backend(
    loaded: LoadedModel,
    backend: str,
    args: argparse.Namespace,
    progress: Progress,
    task: TaskID,
) -> BackendFigures:
    figures = BackendFigures()
    engine = engine_for(loaded, backend)
    ids = prompts(loaded, CONCURRENCY)
    constraint = schema_constraint(PERSON_SCHEMA)
    engine.grammars.backend()  # the library's tokenizer tables: once per engine, not measured
    engine.grammars.wait(constraint)  # its compile is (c), not (a)
    free_params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    schema_params = SamplingParams(max_tokens=args.max_tokens, constraint=constraint)
    warm_up(engine, ids, constraint)
    progress.advance(task)
    on_step = timed_mask(engine, figures)
    for round_index in range(args.rounds):
        free = [EngineRequest(f"f{round_index}-{i}", p, free_params) for i, p in enumerate(ids)]
        mixed = [
            EngineRequest(f"m{round_index}-{i}", p, schema_params if i % 2 else free_params)
            for i, p in enumerate(ids)
        ]
        for name, batch in (("free", free), ("mixed", mixed)):
            run = run_batch(engine, batch, on_step if name == "mixed" else None)
            produced = sum(len(t) for t in run.tokens.values())
            rate = produced / run.region.seconds
            (figures.free_tok_s if name == "free" else figures.mixed_tok_s).append(rate)
            figures.regions.append({"round": round_index, "batch": name, **asdict(run.region)})
            if name == "mixed":
                constrained = [r.request_id for r in batch if r.sampling.constraint is not None]
                figures.valid_with = valid_share([run.texts[r] for r in constrained])
                for rid in constrained:
                    reason = run.finishes[rid]
                    figures.constrained_finish[reason] = (
                        figures.constrained_finish.get(reason, 0) + 1
                    )
            progress.advance(task)
    odd = [p for i, p in enumerate(ids) if i % 2]
    plain = [
        EngineRequest(f"plain-{i}", p, SamplingParams(max_tokens=args.max_tokens))
        for i, p in enumerate(odd)
    ]
    figures.valid_without = valid_share(list(run_batch(engine, plain).texts.values()))
    progress.advance(task)
    compile_times(engine, args.compiles, figures)
    progress.advance(task)
    return figures


def warm_up(engine: Engine, ids: list[list[int]], constraint: Constraint) -> None:
    """One short mixed batch, untimed: the engine's first batches (allocator, kernels, the
    first masks) are slower than the rest, and would count against whichever batch ran
    first."""
    free = SamplingParams(max_tokens=WARM_UP_TOKENS, ignore_eos=True)
    constrained = SamplingParams(max_tokens=WARM_UP_TOKENS, constraint=constraint)
    batch = [
        EngineRequest(f"warm-{i}", p, constrained if i % 2 else free) for i, p in enumerate(ids)
    ]
    run_batch(engine, batch)


def valid_share(texts: list[str]) -> float:
    """Share of texts that are strict JSON validating against PERSON_SCHEMA."""
    good = 0
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), PERSON_SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            continue
        good += 1
    return good / len(texts)


def compile_times(engine: Engine, count: int, figures: BackendFigures) -> None:
    """Cold: schemas the engine has not compiled (PERSON_SCHEMA with a field renamed);
    cached: the same again, answered from the compile cache."""
    variants = []
    for i in range(count):
        schema = json.loads(json.dumps(PERSON_SCHEMA))
        schema["properties"][f"note_{i}"] = schema["properties"].pop("name")
        schema["required"] = [f"note_{i}" if r == "name" else r for r in schema["required"]]
        variants.append(schema_constraint(schema))
    for times in (figures.compile_cold_ms, figures.compile_cached_ms):
        for constraint in variants:
            started = time.perf_counter()
            engine.grammars.wait(constraint)
            times.append((time.perf_counter() - started) * 1e3)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(figures: BackendFigures) -> dict[str, Any]:
    mask_share = [m / s for m, s in zip(figures.mask_ms, figures.step_ms, strict=True) if s > 0]
    return {
        "free_tok_s_rounds": figures.free_tok_s,
        "mixed_tok_s_rounds": figures.mixed_tok_s,
        "free_tok_s": statistics.median(figures.free_tok_s),
        "mixed_tok_s": statistics.median(figures.mixed_tok_s),
        "ratio": figures.ratio,
        "mask_ms_p50": percentile(figures.mask_ms, 0.5),
        "mask_ms_p99": percentile(figures.mask_ms, 0.99),
        "mask_share_of_step_p50": percentile(mask_share, 0.5),
        "compile_cold_ms_p50": percentile(figures.compile_cold_ms, 0.5),
        "compile_cold_ms_p99": percentile(figures.compile_cold_ms, 0.99),
        "compile_cached_ms_p50": percentile(figures.compile_cached_ms, 0.5),
        "compile_cached_ms_p99": percentile(figures.compile_cached_ms, 0.99),
        "valid_with": figures.valid_with,
        "constrained_complete": figures.constrained_finish.get("stop", 0)
        / sum(figures.constrained_finish.values()),
        "valid_without": figures.valid_without,
        "other_cores_max": max(r["other_cores"] for r in figures.regions),
        "load_max": max(max(r["load_start"], r["load_end"]) for r in figures.regions),
    }


def print_table(summaries: dict[str, dict[str, Any]], console: Console) -> None:
    table = Table(title="Structured output (64 concurrent, half under a JSON Schema)")
    table.add_column("backend")
    for column in (
        "free tok/s",
        "mixed tok/s",
        "ratio",
        "mask p50/p99 ms",
        "compile cold p50/p99 ms",
        "cached p50 ms",
        "valid with/without",
    ):
        table.add_column(column, justify="right")
    for backend, s in summaries.items():
        table.add_row(
            backend,
            f"{s['free_tok_s']:.1f}",
            f"{s['mixed_tok_s']:.1f}",
            f"{s['ratio']:.3f}x",
            f"{s['mask_ms_p50']:.2f}/{s['mask_ms_p99']:.2f}",
            f"{s['compile_cold_ms_p50']:.1f}/{s['compile_cold_ms_p99']:.1f}",
            f"{s['compile_cached_ms_p50']:.3f}",
            f"{s['valid_with']:.0%}/{s['valid_without']:.0%}",
        )
    console.print(table)


def markdown_section(
    summaries: dict[str, dict[str, Any]], args: argparse.Namespace, command: str
) -> str:
    cpu = machine()["cpu"]
    header = [
        "backend", "free tok/s", "mixed tok/s", "mixed / free",
        "mask fill+apply per step p50 / p99", "share of the step (p50)",
        "compile cold p50 / p99", "compile cached p50 / p99",
        "answers valid with / without the schema", "constrained answers complete",
        "load average (max)",
        "other processes' cores (max)",
    ]  # fmt: skip
    lines = [
        "## Structured output",
        "",
        f"`{command}` (bench/structured.py), engine in one process, {MODEL}, "
        f"{CONCURRENCY} concurrent requests of up to {args.max_tokens} output tokens, "
        f"an untimed warm-up batch, then {args.rounds} rounds alternating the two batches "
        "(tok/s: the median over rounds; each round's free / mixed below the table); "
        f"CPU: {cpu}, {os.cpu_count()} cores."
        " The mixed batch is 32 requests under a JSON Schema of seven "
        "fields (nested object, enums, ranges, a pattern, an array of 1-3 items) and 32 free "
        "ones; the free batch is all 64 free (run to max_tokens); the constrained stop when "
        "their JSON is complete, so the mixed batch's last steps run with its 32 free rows only: "
        "the ratio holds that batch shape as well as the constraint's own cost, which is the "
        "mask column (fill + apply, and its share of the step). Goal: mixed >= 0.95x free "
        "output tok/s.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for backend, s in summaries.items():
        lines.append(
            f"| {backend} | {s['free_tok_s']:.1f} | {s['mixed_tok_s']:.1f} | {s['ratio']:.3f}x | "
            f"{s['mask_ms_p50']:.2f} / {s['mask_ms_p99']:.2f} ms | "
            f"{s['mask_share_of_step_p50']:.1%} | "
            f"{s['compile_cold_ms_p50']:.1f} / {s['compile_cold_ms_p99']:.1f} ms | "
            f"{s['compile_cached_ms_p50']:.3f} / {s['compile_cached_ms_p99']:.3f} ms | "
            f"{s['valid_with']:.0%} / {s['valid_without']:.0%} | "
            f"{s['constrained_complete']:.0%} | {s['load_max']:.1f} | "
            f"{s['other_cores_max']:.2f} |"
        )
    lines.append("")
    for backend, s in summaries.items():
        rounds = ", ".join(
            f"{free:.1f} / {mixed:.1f}"
            for free, mixed in zip(s["free_tok_s_rounds"], s["mixed_tok_s_rounds"], strict=True)
        )
        ratios = [
            m / f for f, m in zip(s["free_tok_s_rounds"], s["mixed_tok_s_rounds"], strict=True)
        ]
        verdict = "met" if s["ratio"] >= RATIO_GOAL else "missed"
        lines.append(
            f"- {backend}: mixed / free {s['ratio']:.3f}x (goal >= {RATIO_GOAL}x: {verdict}); "
            f"free / mixed tok/s by round: {rounds} (round ratios "
            f"{min(ratios):.2f}-{max(ratios):.2f}x)."
        )
    return "\n".join(lines) + "\n"


def plot(summaries: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (speed, compile_axis) = plt.subplots(1, 2, figsize=(10, 4))
    _paired_bars(
        speed, summaries, ("free_tok_s", "64 free"), ("mixed_tok_s", "32 schema + 32 free")
    )
    speed.set_ylabel("output tokens/s")
    _paired_bars(
        compile_axis,
        summaries,
        ("compile_cold_ms_p50", "cold p50"),
        ("compile_cold_ms_p99", "cold p99"),
    )
    compile_axis.set_ylabel("schema compile (ms)")
    save_figure(fig, path, f"Structured output on {MODEL}, {CONCURRENCY} concurrent")


def _paired_bars(
    axis: Any, summaries: dict[str, dict[str, Any]], left: tuple[str, str], right: tuple[str, str]
) -> None:
    """Two bars per backend, side by side: (summary key, legend label) each."""
    backends = list(summaries)
    width = 0.38
    for offset, (key, label) in ((-width / 2, left), (width / 2, right)):
        positions = [p + offset for p in range(len(backends))]
        axis.bar(positions, [summaries[b][key] for b in backends], width, label=label)
    axis.set_xticks(list(range(len(backends))), backends)
    axis.legend()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and tokens")
    parser.add_argument("--rounds", type=int, help="free/mixed rounds per backend (3; quick 1)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (128; quick 32)")
    parser.add_argument("--compiles", type=int, help="schemas compiled cold (20; quick 5)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="grammar backends to run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    return with_quick_defaults(
        args, {"rounds": (3, 1), "max_tokens": (128, 32), "compiles": (20, 5)}
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console(width=160)
    loaded = load_model(MODEL)
    backends = args.backends.split(",")
    figures: dict[str, BackendFigures] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        for backend in backends:
            task = progress.add_task(backend, total=2 * args.rounds + 3)
            figures[backend] = measure_backend(loaded, backend, args, progress, task)
    summaries = {backend: summary(f) for backend, f in figures.items()}
    print_table(summaries, console)
    command = "flock -x /tmp/kvmesh-cpu.lock " + repeat_command(
        "bench.structured", args, parse_args
    )
    payload = {
        "command": command,
        "model": MODEL,
        "concurrency": CONCURRENCY,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "schema": PERSON_SCHEMA,
        "machine": {
            "cpu": machine()["cpu"],
            "cores": os.cpu_count(),
            "torch": torch.__version__,
        },
        "summary": summaries,
        "backends": {b: asdict(f) for b, f in figures.items()},
    }
    results = write_results("structured", payload, args.out)
    plot(summaries, args.out / "structured.png")
    write_section(markdown_section(summaries, args, command))
    png = args.out / "structured.png"
    console.print(f"wrote {results}, {png} and the Structured output section of {BENCHMARKS}")


if __name__ == "__main__":
    main()
