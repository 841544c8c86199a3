"""kvmesh against vLLM's CPU build and transformers, side by side, as a user choosing would.

    make bench-peers                          # builds .venv-vllm, runs this under the CPU lock
    .venv-vllm/bin/python -m bench.peers [--quick] [--rows offline serving single prefix]
        [--model smollm2-135m|qwen2-random]

Not a test. One run of this script measures every system on the same machine, one system at a
time (the servers stay up together and take turns on each row), on the same weights (the
default model written once as a Hugging Face folder by kvmesh's own loader, fp32) and the same
prompt token ids:

  offline   64 requests, prompts 64-512 tokens, 128 out, EOS ignored: kvmesh's LLM.generate,
            vLLM's LLM.generate, transformers' generate() in static batches of 8
  serving   32 concurrent requests, 128-token prompts, 64 out: `kvmesh up --mode colocated`
            through the async SDK (one task per request) vs vLLM's OpenAI server (streaming
            /v1/completions, ignore_eos); `kvmesh up --mode disaggregated` beside them, and
            `kvmesh up --mode colocated --engine vllm` (the mesh in front of vLLM's engine, with
            the batch limits vLLM's server takes by default: what the mesh costs)
  single    one request at a time, 128-token prompt, 128 out: tok/s and TTFT
  prefix    a fresh 1,024-token prefix + 32-token suffix (cold TTFT), then the same prefix with
            new suffixes (warm TTFT); three such prefixes a run, the medians

vLLM is started the way its CPU documentation recommends: compiled (inductor, its default),
VLLM_CPU_OMP_THREADS_BIND over every core, VLLM_CPU_KVCACHE_SPACE sized for the workload,
tcmalloc preloaded where the system has it (vLLM preloads torch's OpenMP itself). Each system
gets one warm-up, then each row runs twice on fresh prompts (a rerun on the same prompts would
be served from the prefix cache). Each run of a row goes to every system in turn, in the
opposite order on the second run (offline: a child process with its own warm-up for each run
of each library), so that minutes in which the host runs this guest slower (which nothing
inside the guest shows) weigh on every system alike. Each run of a row waits for the machine
to settle first (a vLLM worker that just served polls at 0.09 cores for a while; the idle
servers' processes then use under 0.01 cores each, counted with the other processes).
Greedy outputs are compared token by token across systems. Every timed region records the
load average and the CPU that other processes used meanwhile; a region disturbed by them is
run again and both are kept. Before each timed run the machine is probed (a 1024^3 matmul
rate and a 256 MiB copy's bandwidth, under half a second): the host's slow minutes show in no
process, and a row's figure is read against what the machine gave just before; a run whose
probe read well under the fastest one before it (SLOW_HOST_SHARE) is run again too, and a
row's figure comes from its runs neither disturbed nor on a slow host where it has any. Writes the
"Peers" section of BENCHMARKS.md and bench/results/peers.json + peers.png.

--model qwen2-random runs the same rows on a second family: a Qwen2 checkpoint (Q/K/V bias) of
SmolLM2-135M's shapes and tokenizer with random weights (seed 0), written once as a folder;
its own section ("Peers ... (qwen2-random)") and peers-qwen2-random.json/.png.

--device cuda runs the same rows on a GPU in bfloat16: kvmesh's engine on the device (its
torch path: the C kernels are CPU float32 only), transformers there, and the ordinary `vllm`
package as the peer where it is installed (--skip-vllm where it is not: the table then says
"not run"); the steps row is CPU-only. Its own section and peers[-MODEL]-cuda.json/.png.

--dtype bfloat16 on the CPU runs kvmesh and vLLM in bfloat16 (AMX or AVX-512 BF16 where the
CPU has them), and transformers in float32 as the reference their greedy outputs are compared
with: how far the faster numbers move the tokens. No steps row (it measures the fp32 peak).
Its own section and peers[-MODEL]-bfloat16.json/.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.report import BENCHMARKS, RESULTS, write_results, write_section
from kvmesh.bench_report import percentile
from kvmesh.stack import Mode

T = TypeVar("T")
HEADING = "## Peers: kvmesh vs vLLM CPU"
MODEL = "smollm2-135m"
KVMESH_ON_VLLM = "kvmesh on vllm"
# kvmesh system -> (`kvmesh up --mode`, `--engine`).
STACKS: dict[str, tuple[Mode, str]] = {
    "kvmesh colocated": ("colocated", "native"),
    "kvmesh disaggregated": ("disaggregated", "native"),
    KVMESH_ON_VLLM: ("colocated", "vllm"),
}
# vLLM's OpenAI server's own batch limits on a CPU (vLLM 0.32's defaults there), given to the
# vLLM-backed workers so that the two run the same scheduler settings.
VLLM_SERVER_BATCH_ARGS = ("--max-num-batched-tokens=2048", "--max-num-seqs=128")
# --model: the default model, or a Qwen2 checkpoint of its shapes with random weights.
MODELS = (MODEL, "qwen2-random")
# Far from `kvmesh up`'s default ports and from bench.mesh's offset; each further kvmesh
# stack 100 ports on.
PORT_OFFSET = 1700
VLLM_PORT = 18851
# The rows run on servers, in the order each run takes them.
SERVER_ROWS = ("serving", "single", "prefix")
# Another process using more than this many cores during a timed region disturbs it.
DISTURBED_CORES = 0.25
# Before each server row the machine settles: every process together under SETTLED_CORES over
# SETTLE_WINDOW_S, waited for at most SETTLE_MOST_S. A vLLM worker that just served polls for
# its next step harder for a while: an idle one took 0.09 cores through the next system's
# serving row (0.006 once settled), that system's run slower by that much.
SETTLED_CORES = 0.05
SETTLE_WINDOW_S = 0.5
SETTLE_MOST_S = 20.0
TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)
# kvmesh's default large-batch projections first (its figures), then the alternatives.
LARGE_BATCH_MODES = ("auto", "onednn", "torch")
# The panel kernel asking for its next panel ahead, and not: "auto" prefetches on Intel and on
# AMD with AVX-512 only (linear_kernel.PREFETCH_BY_DEFAULT), so both are timed for the CPUs
# not yet decided.
PANEL_PREFETCH_MODES = ("panels-prefetch", "panels")
# What runs the larger steps' projections, by SmallBatchLinear.large's type.
LARGE_PRODUCTS = {
    "PanelLinear": "the panel kernel",
    "PackedLinear": "oneDNN on reordered weights",
    "NoneType": "torch's matmul",
}
STEP_REPEATS = 7
PEAK_SIZE = 2048  # the steps row's peak: 2048^3 products
# machine_probe, before each timed run: products of 1024^3, best of 5.
PROBE_SIZE = 1024
PROBE_REPEATS = 5
SLOW_HOST_SHARE = 0.85
"""A run whose machine probe read under this share of the fastest probe its phase had taken so
far is run again on its spare prompts, as a disturbed one is: the host runs this guest slower
for minutes at a time, which no load, process or steal inside it shows. On an Intel Xeon model
207 guest on 2026-12-06 the probes of one run read 189-313 GFLOP/s; `kvmesh up --engine vllm`
ran after probes of 221 and 189, vLLM's own server after 281 and 280, and read 0.84x of it."""
P99_TTFT_GOAL = 0.8  # issue 12: the serving row's TTFT p99 at most this share of vLLM's
KV_CACHE_GIB = 3  # 64 x 640 tokens of fp32 KV is ~1.9 GB
# --device -> the weights' dtype every system runs in by default (the usual one there).
DTYPES = {"cpu": "float32", "cuda": "bfloat16"}


@dataclass(slots=True, frozen=True)
class Workload:
    offline_requests: int = 64
    offline_min_prompt: int = 64
    offline_max_prompt: int = 512
    offline_output: int = 128
    hf_batch: int = 8
    serving_requests: int = 32
    serving_prompt: int = 128
    serving_output: int = 64
    single_requests: int = 3
    single_prompt: int = 128
    single_output: int = 128
    prefix_tokens: int = 1024
    suffix_tokens: int = 32
    # Fresh prefixes a run of the prefix row meets (the cold TTFT is their median: one
    # request a run read 1,014 and 1,272 ms for the same server minutes apart).
    cold_prefixes: int = 3
    warm_requests: int = 3  # requests after each cold one, sharing its prefix
    runs: int = 2

    @classmethod
    def quick(cls) -> Workload:
        return cls(
            offline_requests=8,
            offline_output=16,
            serving_requests=8,
            serving_output=16,
            single_requests=1,
            single_output=16,
            prefix_tokens=256,
            cold_prefixes=1,
            warm_requests=1,
            runs=1,
        )


# ---- prompts: token ids, built once, fresh for every run -----------------------------------


def random_ids(rng: random.Random, count: int, vocab: int) -> list[int]:
    # Ids below 100 are the tokenizer's special and byte tokens.
    return [rng.randrange(100, vocab) for _ in range(count)]


def prompts_for(work: Workload, vocab: int, seed: int) -> dict[str, Any]:
    """Every row's prompts for one run (seed 0 is the warm-up): the same for every system."""
    rng = random.Random(seed)
    offline = [
        random_ids(rng, rng.randint(work.offline_min_prompt, work.offline_max_prompt), vocab)
        for _ in range(work.offline_requests)
    ]
    prefixes = [random_ids(rng, work.prefix_tokens, vocab) for _ in range(work.cold_prefixes)]
    return {
        "offline": offline,
        "serving": [
            random_ids(rng, work.serving_prompt, vocab) for _ in range(work.serving_requests)
        ],
        "single": [random_ids(rng, work.single_prompt, vocab) for _ in range(work.single_requests)],
        "prefix": [
            [
                prefix + random_ids(rng, work.suffix_tokens, vocab)
                for _ in range(1 + work.warm_requests)
            ]
            for prefix in prefixes
        ],
    }


# ---- the CPU others used during a timed region ---------------------------------------------


def _cpu_ticks() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, user + system ticks) of every process."""
    ticks = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return ticks


def _children() -> set[int]:
    """The processes this one started and that still run."""
    return {pid for pid, (parent, _) in _cpu_ticks().items() if parent == os.getpid()}


def _steal_ticks() -> int:
    """Ticks stolen from this machine's CPUs so far (the `cpu` line of /proc/stat)."""
    return _machine_ticks()[8]


def _busy_ticks() -> int:
    """Ticks this machine's CPUs ran any process so far (user, nice, system, irq, softirq)."""
    ticks = _machine_ticks()
    return sum(ticks[index] for index in (1, 2, 3, 6, 7))


def _machine_ticks() -> list[int]:
    """The `cpu` line of /proc/stat as numbers after its name at [1:] (zeros if unread)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return [0, *(int(field) for field in fields[1:])]
    except (OSError, ValueError):
        return [0] * 11


async def settled() -> float:
    """Waits until every process together uses under SETTLED_CORES over a window (at most
    SETTLE_MOST_S); the seconds waited."""
    started = time.perf_counter()
    per_second = os.sysconf("SC_CLK_TCK") * SETTLE_WINDOW_S
    while time.perf_counter() - started < SETTLE_MOST_S:
        before = _busy_ticks()
        await asyncio.sleep(SETTLE_WINDOW_S)
        if (_busy_ticks() - before) / per_second < SETTLED_CORES:
            break
    return time.perf_counter() - started


def _ours(ticks: dict[int, tuple[int, int]], roots: Collection[int] = ()) -> set[int]:
    """The system under test: this process and the descendants of `roots` (by default its
    own descendants), the roots included."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in ticks.items():
        children.setdefault(parent, []).append(pid)
    ours, stack = {os.getpid()}, list(roots) or [os.getpid()]
    while stack:
        pid = stack.pop()
        ours.add(pid)
        stack.extend(children.get(pid, []))
    return ours


@dataclass(slots=True)
class Region:
    """Wall time of a timed region, the load average around it and the cores other
    processes kept busy meanwhile."""

    seconds: float = 0.0
    load_start: float = 0.0
    load_end: float = 0.0
    other_cores: float = 0.0
    steal_cores: float = 0.0
    """Cores the hypervisor gave other guests while this one wanted them (/proc/stat's steal):
    a slower machine that no process of this one shows."""
    own_cores: dict[str, float] = field(default_factory=dict)
    """Cores each kind of process of the system under test used (by its name: the module a
    kvmesh service runs, vLLM's process titles), where the serving work goes."""

    @property
    def disturbed(self) -> bool:
        return is_disturbed(asdict(self))


def slowed(machine: dict[str, float], fastest_gflops: float) -> bool:
    """The probe before a run read under SLOW_HOST_SHARE of the fastest one before it."""
    return machine["matmul_gflops"] < SLOW_HOST_SHARE * fastest_gflops


def calm(run: dict[str, Any]) -> bool:
    """A run neither disturbed by other processes nor started on a slowed host."""
    return not is_disturbed(run["region"]) and not run.get("slow_host", False)


def is_disturbed(region: dict[str, Any]) -> bool:
    """Other processes and the hypervisor took more than DISTURBED_CORES during the region (a
    Region as a dict, as the reports keep it; one written before steal was recorded counts
    other processes only)."""
    return region["other_cores"] + region.get("steal_cores", 0.0) > DISTURBED_CORES


@contextlib.contextmanager
def timed_region(roots: Collection[int] = ()) -> Iterator[Region]:
    """roots: the processes of the system under test (a server's), whose descendants are
    its too; the others, idle servers of other systems included, are other processes. By
    default every descendant of this process is the system's."""
    region = Region(load_start=os.getloadavg()[0])
    before, steal_before = _cpu_ticks(), _steal_ticks()
    started = time.perf_counter()
    yield region
    region.seconds = time.perf_counter() - started
    after, steal_after = _cpu_ticks(), _steal_ticks()
    ours = _ours(after, roots) | _ours(before, roots)
    others = sum(
        ticks - before.get(pid, (0, 0))[1]
        for pid, (_, ticks) in after.items()
        if pid not in ours and ticks >= before.get(pid, (0, 0))[1]
    )
    per_second = os.sysconf("SC_CLK_TCK") * max(region.seconds, 1e-9)
    region.other_cores = others / per_second
    region.steal_cores = (steal_after - steal_before) / per_second
    for pid in ours & set(after):
        used = after[pid][1] - before.get(pid, (0, 0))[1]
        if used > 0:
            name = _process_name(pid)
            region.own_cores[name] = region.own_cores.get(name, 0.0) + used / per_second
    region.load_end = os.getloadavg()[0]


def _process_name(pid: int) -> str:
    """`services.worker` for `python -m services.worker ...`, else the process title's first
    word ("VLLM::EngineCore", "python")."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    words = [word.decode(errors="replace") for word in argv if word]
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1]
    return Path(words[0]).name if words else "?"


# ---- offline row: each library in a child process of its own -------------------------------


def offline_child(system: str, model_dir: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in the child: warm-up, then one run's prompts (its spare too when disturbed or
    on a slowed host: spec's fastest_gflops is the fastest probe of the runs before); outputs
    and timed regions."""
    work = Workload(**spec["workload"])
    generate = _offline_generator(system, model_dir, work, spec["device"], spec["dtype"])
    generate(spec["warmup"])
    runs: list[dict[str, Any]] = []
    fastest = spec["fastest_gflops"]
    for prompts, spare in ((spec["prompts"], False), (spec["spare"], True)):
        machine = machine_probe()
        fastest = max(fastest, machine["matmul_gflops"])
        with timed_region() as region:
            outputs = generate(prompts)
        run = {"region": asdict(region), "outputs": outputs, "spare": spare, "machine": machine}
        run["slow_host"] = slowed(machine, fastest)
        runs.append(run)
        if calm(run):
            break
    return {"runs": runs}


def _offline_generator(
    system: str, model_dir: str, work: Workload, device: str, dtype: str
) -> Callable[[list[list[int]]], list[list[int]]]:
    out = work.offline_output
    if system == "kvmesh":
        from services.worker.engine.api import SamplingParams
        from services.worker.engine.llm import LLM

        llm = LLM(
            model_dir,
            kv_cache_bytes=KV_CACHE_GIB << 30,
            max_num_seqs=64,
            device=device,
            dtype=dtype,
        )
        sampling = SamplingParams(max_tokens=out, ignore_eos=True)
        return lambda prompts: [c.token_ids for c in llm.generate(prompts, sampling)]
    if system == "vllm":
        import vllm

        engine = vllm.LLM(model=model_dir, dtype=dtype, max_model_len=2048, seed=0)
        params = vllm.SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)

        def run(prompts: list[list[int]]) -> list[list[int]]:
            requests = [vllm.TokensPrompt(prompt_token_ids=p) for p in prompts]
            done = engine.generate(requests, params, use_tqdm=False)
            return [list(d.outputs[0].token_ids) for d in done]

        return run
    if system == "transformers":
        return _transformers_generator(model_dir, work, device, reference_dtype(device, dtype))
    raise ValueError(f"unknown offline system {system!r}")


def reference_dtype(device: str, dtype: str) -> str:
    """transformers' dtype: float32 on the CPU (the reference that the others' greedy tokens
    are compared with, whatever they run in), the run's dtype on a GPU."""
    return "float32" if device == "cpu" else dtype


def _transformers_generator(
    model_dir: str, work: Workload, device: str, dtype: str
) -> Callable[[list[list[int]]], list[list[int]]]:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    torch.nn.Module.to(model, device)
    model.generation_config.eos_token_id = None  # like ignore_eos

    def run(prompts: list[list[int]]) -> list[list[int]]:
        outputs = []
        for start in range(0, len(prompts), work.hf_batch):
            batch = prompts[start : start + work.hf_batch]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device
            )
            with torch.inference_mode():
                generated = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=work.offline_output,
                    min_new_tokens=work.offline_output,
                    do_sample=False,
                    pad_token_id=0,
                )
            outputs += generated[:, width:].tolist()
        return outputs

    return run


def steps_child(model_dir: str) -> dict[str, Any]:
    """kvmesh's step times against the machine: the fp32 matmul peak, a 512-token prefill
    step, a 32-row decode step and the batch-1 step against the weight-read floor."""
    import torch

    from bench.engine import copy_bandwidth, weight_bytes
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.engine import Engine
    from services.worker.engine.loader import load_model
    from services.worker.engine.model_runner import BatchEntry, ModelRunner

    loaded = load_model(model_dir)
    # One runner per way the larger steps' projections run, on the same weights, measured
    # alternately so that both see the same machine.
    runners = {
        mode: Engine(
            loaded,
            EngineConfig(model=model_dir, num_kv_blocks=32 * 24 + 64, large_batch_linear=mode),
        ).runner
        for mode in (*LARGE_BATCH_MODES, *PANEL_PREFETCH_MODES)
    }
    config = loaded.config
    rng = random.Random(7)
    ids = lambda n: random_ids(rng, n, config.vocab_size)  # noqa: E731
    table = lambda i, n: list(range(i * n, (i + 1) * n))  # noqa: E731
    context = 300
    batches = {
        "prefill_512": [BatchEntry(ids(512), 0, table(0, 32))],
        "decode_32": [BatchEntry(ids(1), context, table(i, 24)) for i in range(32)],
        "decode_1": [BatchEntry(ids(1), context, table(0, 24))],
    }
    peak_products = square_products(PEAK_SIZE)
    peak_s: list[float] = []
    by_mode: dict[str, dict[str, float]] = {mode: {} for mode in runners}
    for name, batch in batches.items():
        times: dict[str, list[float]] = {mode: [] for mode in runners}
        for runner in runners.values():
            runner.forward(batch)
        # The peak is measured between the steps too: on a shared machine the best of many
        # short samples is the least disturbed one.
        for _ in range(STEP_REPEATS):
            peak_s += [_seconds(product) for product in peak_products]
            for mode, runner in runners.items():
                times[mode].append(_seconds(functools.partial(runner.forward, batch)))
        for mode in runners:
            by_mode[mode][name] = min(times[mode])
    seconds = by_mode[LARGE_BATCH_MODES[0]]
    peak = 2 * PEAK_SIZE**3 / min(peak_s)
    project = runners[LARGE_BATCH_MODES[0]].project
    block_size = runners[LARGE_BATCH_MODES[0]].block_size
    shapes = model_shapes(loaded.config)
    flops = {
        "prefill_512": step_flops(shapes, [(0, 512)], logit_rows=1),
        "decode_32": step_flops(shapes, [(context, 1)] * 32, logit_rows=32),
    }
    return {
        "matmul_peak_flops": peak,
        "step_s": seconds,
        "step_s_by_large_batch_linear": by_mode,
        "step_rows": {
            name: sum(len(entry.token_ids) for entry in batch) for name, batch in batches.items()
        },
        # Steps of up to this many rows run on the small-batch kernel in the default mode.
        "small_batch_max_rows": getattr(project, "float_max_rows", 0),
        "large_batch_product": type(getattr(project, "large", None)).__name__,
        "panel_prefetch": getattr(getattr(project, "large", None), "prefetch", False),
        # Steps of this many rows or more run some projections on oneDNN ("auto" measured
        # it faster there when the engine was built: linear_crossover.py); None: none.
        "onednn_from_rows": runners[LARGE_BATCH_MODES[0]].onednn_from_rows,
        "step_flops": flops,
        "shapes": asdict(shapes),
        "weight_bytes": weight_bytes(loaded),
        # What a decode row reads of its KV: every layer's K and V of each token it attends.
        "kv_bytes_per_token": ModelRunner.bytes_per_block(config, loaded.dtype, block_size)
        // block_size,
        "decode_context": context,
        "copy_bytes_per_s": copy_bandwidth(),
        "threads": torch.get_num_threads(),
    }


def square_products(size: int) -> list[Callable[[], object]]:
    """fp32 products of two size x size matrices, each way this machine has: torch's and,
    where torch has it, oneDNN's on a reordered weight (oneDNN runs AVX-512 code where torch's
    MKL product keeps to AVX2 on AMD: the machine's peak is the faster of the two)."""
    import torch

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    products: list[Callable[[], object]] = [lambda: torch.mm(a, b)]
    if torch.backends.mkldnn.is_available():
        reordered = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), size)
        products.append(
            lambda: torch.ops.mkldnn._linear_pointwise(a, reordered, None, "none", [], "")
        )
    return products


def machine_probe() -> dict[str, float]:
    """What the machine gives this minute, in under half a second once bench.engine is
    imported: the fp32 matmul rate (PROBE_SIZE^3, the best of PROBE_REPEATS of each product)
    and the copy bandwidth the steps row measures (bench.engine.copy_bandwidth: 256 MiB, past
    the largest L3 of these machines, the model 207 Xeon's 300 MiB). Taken before each timed
    run: the host runs this guest slower for minutes at a time, which nothing inside the guest
    shows, and a row's figure is read against the machine it ran on."""
    from bench.engine import copy_bandwidth

    products = square_products(PROBE_SIZE)
    for product in products:
        product()
    matmul_s = min(_seconds(product) for product in products for _ in range(PROBE_REPEATS))
    return {
        "matmul_gflops": 2 * PROBE_SIZE**3 / matmul_s / 1e9,
        "copy_gb_s": copy_bandwidth() / 1e9,
    }


def _seconds(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


@dataclass(slots=True, frozen=True)
class Shapes:
    layer_params: int  # weights of one layer's projections
    num_layers: int
    heads_dim: int  # query heads x head dim
    lm_head: int  # vocab x hidden


def model_shapes(config: Any) -> Shapes:
    hidden, heads, kv = config.hidden_size, config.num_heads, config.num_kv_heads
    qkv = hidden * (heads + 2 * kv) * config.head_dim
    o = heads * config.head_dim * hidden
    mlp = 3 * hidden * config.intermediate_size
    return Shapes(
        qkv + o + mlp, config.num_layers, heads * config.head_dim, config.vocab_size * hidden
    )


def step_flops(shapes: Shapes, chunks: list[tuple[int, int]], logit_rows: int) -> float:
    """Multiply-adds x 2 of a step computing `chunks` (start position, tokens) causally."""
    tokens = sum(n for _, n in chunks)
    # Each query at position p scores p + 1 keys and sums as many values: 2 x 2 x heads x dim.
    attended = sum(n * start + n * (n + 1) // 2 for start, n in chunks)
    per_layer = 2 * shapes.layer_params * tokens + 4 * shapes.heads_dim * attended
    return per_layer * shapes.num_layers + 2 * shapes.lm_head * logit_rows


def offline_flops(shapes: Shapes, prompts: list[list[int]], output: int) -> float:
    """The work of the offline row: every prompt and all but the last output token computed."""
    return sum(step_flops(shapes, [(0, len(p) + output - 1)], logit_rows=output) for p in prompts)


def run_child(python: str, kind: str, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """`python -m bench.peers --child kind args...`; its JSON result."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        result_path = Path(out.name)
    command = [python, "-m", "bench.peers", "--child", kind, "--result", str(result_path), *args]
    try:
        subprocess.run(command, env=os.environ | env, check=True)
        return json.loads(result_path.read_text())
    finally:
        result_path.unlink(missing_ok=True)


# ---- servers -------------------------------------------------------------------------------


@dataclass(slots=True)
class Request:
    """What a client saw of one streamed request."""

    ttft_s: float
    e2e_s: float
    token_ids: list[int]
    finish_reason: str = "length"  # as the server said it ("length" with ignore_eos: complete)
    error: str = ""  # the server's message when it ended the request on an error


class Server(Protocol):
    """A running server the rows stream requests to."""

    name: str
    roots: tuple[int, ...]
    """Its processes (their descendants are its too), for the timed regions."""

    async def request(self, prompt: list[int], max_tokens: int) -> Request: ...


class KvmeshServer:
    def __init__(self, name: str, gateway: str, roots: tuple[int, ...]) -> None:
        from kvmesh.client import Client

        self.name = name
        self.roots = roots
        self._client = Client(gateway)

    async def request(self, prompt: list[int], max_tokens: int) -> Request:
        started = time.perf_counter()
        ttft = math.nan
        tokens: list[int] = []
        async with self._client.stream(
            prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ) as stream:
            async for chunk in stream:
                if chunk.token_ids and not tokens:
                    ttft = time.perf_counter() - started
                tokens += chunk.token_ids
            result = stream.result
        return Request(
            ttft, time.perf_counter() - started, tokens, result.finish_reason, result.error_message
        )

    async def close(self) -> None:
        await self._client.close()


class VllmServer:
    def __init__(self, url: str, model: str, roots: tuple[int, ...]) -> None:
        import aiohttp

        self.name = "vllm"
        self.roots = roots
        self._url = url
        self._model = model
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def request(self, prompt: list[int], max_tokens: int) -> Request:
        body = {
            "model": self._model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        started = time.perf_counter()
        ttft = math.nan
        tokens: list[int] = []
        finish_reason = ""
        async with self._session.post(f"{self._url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.content:
                text = line.decode().strip()
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                choices = json.loads(text[6:]).get("choices") or [{}]
                delta = choices[0].get("token_ids") or []
                if delta and not tokens:
                    ttft = time.perf_counter() - started
                tokens += delta
                finish_reason = choices[0].get("finish_reason") or finish_reason
        return Request(ttft, time.perf_counter() - started, tokens, finish_reason)

    async def close(self) -> None:
        await self._session.close()


@contextlib.asynccontextmanager
async def kvmesh_server(
    model_dir: Path, system: str, device: str, dtype: str, port_offset: int = PORT_OFFSET
) -> AsyncIterator[KvmeshServer]:
    from bench.mesh import running_stack

    mode, engine = STACKS[system]
    stack_args = argparse.Namespace(model=str(model_dir))
    on_vllm = engine == "vllm"
    # vLLM's engine gets what its own server gets: the same environment and batch limits.
    env = vllm_environment(device) if on_vllm else {}
    children_before = _children()
    async with running_stack(
        stack_args,
        port_offset=port_offset,
        mode=mode,
        engine=engine,
        worker_args=(
            *(VLLM_SERVER_BATCH_ARGS if on_vllm else ()),
            f"--device={device}",
            f"--dtype={dtype}",
        ),
        env=env,
    ) as services:
        gateway = next(s for s in services if s.name == "gateway").address
        server = KvmeshServer(system, gateway, tuple(_children() - children_before))
        try:
            yield server
        finally:
            await server.close()


def vllm_environment(device: str = "cpu") -> dict[str, str]:
    """vLLM's CPU docs: threads bound to every core, KV space sized, tcmalloc preloaded (on a
    GPU, vLLM's defaults)."""
    if device != "cpu":
        return {}
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
    }
    tcmalloc = next((path for path in TCMALLOC if Path(path).exists()), None)
    if tcmalloc is not None:
        env["LD_PRELOAD"] = ":".join(p for p in (tcmalloc, os.environ.get("LD_PRELOAD")) if p)
    return env


@contextlib.asynccontextmanager
async def vllm_server(model_dir: Path, device: str, dtype: str) -> AsyncIterator[VllmServer]:
    import aiohttp

    command = [
        sys.executable,
        *("-m", "vllm.entrypoints.openai.api_server"),
        *("--model", str(model_dir), "--served-model-name", MODEL),
        *("--dtype", dtype, "--max-model-len", "2048"),
        *("--host", "127.0.0.1", "--port", str(VLLM_PORT)),
        "--disable-log-stats",
    ]
    log = Path(tempfile.gettempdir()) / "kvmesh-bench-peers-vllm.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *command, env=os.environ | vllm_environment(device), stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{VLLM_PORT}"
    try:
        async with aiohttp.ClientSession() as session:
            while True:
                if process.returncode is not None:
                    raise RuntimeError(f"vLLM's server exited; see {log}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{url}/health") as response:
                        if response.status == 200:
                            break
                await asyncio.sleep(1.0)
        server = VllmServer(url, MODEL, (process.pid,))
        try:
            yield server
        finally:
            await server.close()
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), timeout=30)
            except TimeoutError:
                process.kill()
                await process.wait()


# ---- the server rows -----------------------------------------------------------------------


async def serving_row(server: Server, prompts: list[list[int]], output: int) -> dict[str, Any]:
    with timed_region(server.roots) as region:
        started = time.perf_counter()
        done = await asyncio.gather(*(server.request(p, output) for p in prompts))
        duration = time.perf_counter() - started
    tokens = sum(len(r.token_ids) for r in done)
    ttfts = [r.ttft_s * 1000 for r in done]
    # A request that ended after one token has no time per output token; it counts below.
    tpots = [
        (r.e2e_s - r.ttft_s) * 1000 / (len(r.token_ids) - 1) for r in done if len(r.token_ids) > 1
    ]
    incomplete = [
        f"{len(r.token_ids)} of {output} tokens, {r.finish_reason or 'no finish'}"
        + (f": {r.error}" if r.error else "")
        for r in done
        if len(r.token_ids) < output
    ]
    if incomplete:
        print(f"{server.name}: {len(incomplete)} incomplete answers: {incomplete}", file=sys.stderr)
    return {
        "region": asdict(region),
        "tok_s": tokens / duration,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "tpot_p50_ms": percentile(tpots, 50),
        "incomplete": incomplete,
        "outputs": [r.token_ids for r in done],
    }


async def single_row(server: Server, prompts: list[list[int]], output: int) -> dict[str, Any]:
    with timed_region(server.roots) as region:
        done = [await server.request(p, output) for p in prompts]
    return {
        "region": asdict(region),
        "tok_s": statistics.median(len(r.token_ids) / r.e2e_s for r in done),
        "ttft_ms": statistics.median(r.ttft_s * 1000 for r in done),
        "outputs": [r.token_ids for r in done],
    }


async def prefix_row(server: Server, groups: list[list[list[int]]]) -> dict[str, Any]:
    """Each group's first prompt meets a cold prefix, the group's others share it with new
    suffixes; the medians of the cold and of the warm TTFTs."""
    cold: list[Request] = []
    warm: list[Request] = []
    with timed_region(server.roots) as region:
        for prompts in groups:
            cold.append(await server.request(prompts[0], 1))
            warm += [await server.request(p, 1) for p in prompts[1:]]
    return {
        "region": asdict(region),
        "cold_ttft_ms": statistics.median(r.ttft_s * 1000 for r in cold),
        "warm_ttft_ms": statistics.median(r.ttft_s * 1000 for r in warm),
        "outputs": [r.token_ids for r in (*cold, *warm)],
    }


async def server_rows(
    servers: list[Server],
    rows: dict[str, list[str]],
    work: Workload,
    prompt_sets: list[dict[str, Any]],
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Each server's warm-up (prompt set 0), then each run: every row on the run's prompt
    set, the servers (all up, the others idle) taking turns on each row, in the opposite
    order on every other run. A host that runs this guest slower for minutes, which nothing
    inside the guest shows, then slows every system's runs of a row alike instead of whichever
    system's rows fell into those minutes. A run disturbed by other processes, or probed on a
    slowed host (SLOW_HOST_SHARE), is run again on its spare set (fresh prompts: the same ones
    would be served from the prefix cache) and both are kept, the repeat marked. rows: each
    server's (by name)."""
    for server in servers:
        await serving_row(server, prompt_sets[0]["serving"][:4], 4)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        server.name: {row: [] for row in rows[server.name]} for server in servers
    }
    fastest = 0.0
    for run_index, row, server in turns(servers, rows, work.runs):
        own, spare = prompt_sets[1 + run_index], spare_set(prompt_sets, work, run_index)
        for repeat, prompts in enumerate((own, spare)):
            result = await _server_row(server, row, work, prompts)
            fastest = max(fastest, result["machine"]["matmul_gflops"])
            result["slow_host"] = slowed(result["machine"], fastest)
            if repeat:
                result["repeat_of_disturbed"] = run_index
            results[server.name][row].append(result)
            if calm(result):
                break
    return results


def turns(
    servers: list[Server], rows: dict[str, list[str]], runs: int
) -> Iterator[tuple[int, str, Server]]:
    """(run, row, server) in the order server_rows runs them."""
    for run_index in range(runs):
        order = in_turn(servers, run_index)
        for row in SERVER_ROWS:
            for server in order:
                if row in rows[server.name]:
                    yield run_index, row, server


def in_turn(systems: list[T], run_index: int) -> list[T]:
    """The order the systems take a run in: as given, reversed on every other run."""
    return systems if run_index % 2 == 0 else systems[::-1]


def spare_set(prompt_sets: list[dict[str, Any]], work: Workload, run_index: int) -> dict[str, Any]:
    """The prompts run `run_index` is repeated on when it was not calm (disturbed, or on a
    slowed host)."""
    return prompt_sets[1 + work.runs + run_index]


async def _server_row(
    server: Server, row: str, work: Workload, prompts: dict[str, Any]
) -> dict[str, Any]:
    """One run of a row, once the machine settled (the seconds that took: "settle_s") and was
    probed ("machine": probed before settling, it read a vLLM worker that had just served
    polling beside it, 122 GFLOP/s and 12 GB/s against 300 and 23 settled)."""
    settle_s = await settled()
    machine = await asyncio.to_thread(machine_probe)
    if row == "serving":
        result = await serving_row(server, prompts["serving"], work.serving_output)
    elif row == "single":
        result = await single_row(server, prompts["single"], work.single_output)
    elif row == "prefix":
        result = await prefix_row(server, prompts["prefix"])
    else:
        raise ValueError(f"unknown server row {row!r}")
    return result | {"settle_s": settle_s, "machine": machine}


# ---- the whole run -------------------------------------------------------------------------


@dataclass(slots=True)
class Report:
    model: str = MODEL  # a --model choice
    device: str = "cpu"  # a --device choice
    dtype: str = "float32"  # what kvmesh and vLLM run in (--dtype, or the device's default)
    machine: dict[str, Any] = field(default_factory=dict)
    workload: dict[str, Any] = field(default_factory=dict)
    offline: dict[str, Any] = field(default_factory=dict)  # system -> runs
    servers: dict[str, Any] = field(default_factory=dict)  # system -> row -> runs
    steps: dict[str, Any] = field(default_factory=dict)
    agreement: dict[str, Any] = field(default_factory=dict)


def machine(device: str = "cpu") -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    info = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = info.get("Flags", "").split()
    return {
        "gpu": _gpu_name() if device != "cpu" else None,
        "cpu": info.get("Model name", platform.processor()).strip(),
        "cpu_family": info.get("CPU family", "?").strip(),
        "cpu_model": info.get("Model", "?").strip(),
        "cores": os.cpu_count(),
        "avx512": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "load_average_start": os.getloadavg()[0],
    }


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name()


def write_model(folder: Path, model: str) -> Any:
    """The --model as a Hugging Face folder (the default one written by kvmesh's loader); its
    config."""
    from services.worker.engine.loader import load_model, save_hf_folder

    loaded = load_model(MODEL)
    save_hf_folder(loaded, folder)
    if model == "qwen2-random":
        write_random_qwen2(folder, loaded.config)
    return config_of(folder)


def write_random_qwen2(folder: Path, shapes: Any) -> None:
    """Replaces the folder's weights and config by a Qwen2 model of the same shapes with random
    weights (transformers' initialization, seed 0; the Q/K/V biases, which it zeroes, drawn
    too, so they count); the tokenizer files stay."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = json.loads((folder / "config.json").read_text())
    qwen2 = Qwen2Config(
        vocab_size=shapes.vocab_size,
        hidden_size=shapes.hidden_size,
        intermediate_size=shapes.intermediate_size,
        num_hidden_layers=shapes.num_layers,
        num_attention_heads=shapes.num_heads,
        num_key_value_heads=shapes.num_kv_heads,
        max_position_embeddings=shapes.max_position_embeddings,
        rms_norm_eps=shapes.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": shapes.rope_theta},
        tie_word_embeddings=shapes.tie_word_embeddings,
        bos_token_id=config["bos_token_id"],
        eos_token_id=config["eos_token_id"],
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen2)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.02)
    (folder / "model.safetensors").unlink()
    model.save_pretrained(folder)


def config_of(model_dir: Path) -> Any:
    from services.worker.engine.models.registry import family_for_hf_config

    raw = json.loads((model_dir / "config.json").read_text())
    return family_for_hf_config(raw).read_config(raw)


def heading_of(model: str, device: str, dtype: str) -> str:
    heading = HEADING if device == "cpu" else f"## Peers on {device.upper()}: kvmesh vs vLLM"
    if dtype != DTYPES[device]:
        heading += f" in {dtype}"
    return heading if model == MODEL else f"{heading} ({model})"


def results_name(model: str, device: str, dtype: str) -> str:
    name = "peers" if model == MODEL else f"peers-{model}"
    name = name if device == "cpu" else f"{name}-{device}"
    return name if dtype == DTYPES[device] else f"{name}-{dtype}"


async def run(args: argparse.Namespace, console: Console) -> Report:
    work = Workload.quick() if args.quick else Workload()
    report = Report(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        machine=machine(args.device),
        workload=asdict(work),
    )
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-peers-") as scratch:
        model_dir = Path(scratch) / "model"
        config = write_model(model_dir, args.model)
        # Set 0 is the warm-up, sets 1..runs the timed runs, the rest their spares.
        prompt_sets = [
            prompts_for(work, config.vocab_size, seed) for seed in range(2 * work.runs + 1)
        ]
        server_rows_wanted = [row for row in SERVER_ROWS if row in args.rows]
        phases = _phases(args, server_rows_wanted)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
        with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task("peers", total=len(phases))
            for name, phase in phases:
                progress.update(task, description=name)
                await phase(report, model_dir, work, prompt_sets)
                progress.advance(task)
    report.agreement = agreement(report)
    report.machine["load_average_end"] = os.getloadavg()[0]
    return report


Phase = Callable[[Report, Path, Workload, list[dict[str, Any]]], Any]


def _phases(args: argparse.Namespace, server_row_names: list[str]) -> list[tuple[str, Phase]]:
    phases: list[tuple[str, Phase]] = []
    with_vllm = not args.skip_vllm
    offline_systems = [s for s in args.offline_systems if s != "vllm" or with_vllm]
    if "offline" in args.rows and offline_systems:
        phases.append(("offline, taking turns", _offline_phase(offline_systems)))
    if server_row_names:
        systems = {"kvmesh colocated": server_row_names}
        if with_vllm:
            systems["vllm"] = server_row_names
        if "serving" in server_row_names and not args.skip_disaggregated:
            systems["kvmesh disaggregated"] = ["serving"]
        if "serving" in server_row_names and with_vllm and not args.skip_kvmesh_vllm:
            systems[KVMESH_ON_VLLM] = ["serving"]
        phases.append(("servers, taking turns", _servers_phase(systems)))
    # Its peak and floor are the CPU's in float32.
    if "steps" in args.rows and args.device == "cpu" and args.dtype == "float32":
        phases.append(("kvmesh steps vs the machine", _steps_phase))
    return phases


def offline_turns(systems: list[str], runs: int) -> Iterator[tuple[int, str]]:
    """(run, system) in the order the offline row runs them: every system in turn on each run,
    in the opposite order on every other run (transformers, minutes a run, on the first only)."""
    for run_index in range(runs):
        for system in in_turn(systems, run_index):
            if system != "transformers" or run_index == 0:
                yield run_index, system


def _offline_phase(systems: list[str]) -> Phase:
    """Each run of each system in a child process of its own (its own warm-up), the systems
    taking turns as the servers do: a host that runs this guest slower for minutes slows
    every system's runs alike instead of whichever system's children fell into them."""

    async def phase(
        report: Report, model_dir: Path, work: Workload, sets: list[dict[str, Any]]
    ) -> None:
        shapes = model_shapes(config_of(model_dir))
        for run_index, system in offline_turns(systems, work.runs):
            runs = await _offline_run(report, model_dir, system, work, sets, run_index)
            for entry in runs:
                spare = entry.pop("spare")
                prompts = (spare_set(sets, work, run_index) if spare else sets[1 + run_index])[
                    "offline"
                ]
                seconds = entry["region"]["seconds"]
                entry["tok_s"] = sum(len(o) for o in entry["outputs"]) / seconds
                entry["model_flops_per_s"] = (
                    offline_flops(shapes, prompts, work.offline_output) / seconds
                )
                if spare:
                    entry["repeat_of_disturbed"] = run_index
            report.offline.setdefault(system, []).extend(runs)

    return phase


async def _offline_run(
    report: Report,
    model_dir: Path,
    system: str,
    work: Workload,
    sets: list[dict[str, Any]],
    run_index: int,
) -> list[dict[str, Any]]:
    """One offline child: warm-up, run `run_index` (and its spare when disturbed)."""
    spec = {
        "device": report.device,
        "dtype": report.dtype,
        "workload": asdict(work),
        "warmup": sets[0]["offline"][:8],
        "prompts": sets[1 + run_index]["offline"],
        "spare": spare_set(sets, work, run_index)["offline"],
        "fastest_gflops": max(
            (run["machine"]["matmul_gflops"] for runs in report.offline.values() for run in runs),
            default=0.0,
        ),
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(spec, file)
    env = vllm_environment(report.device) if system == "vllm" else {}
    try:
        result = await asyncio.to_thread(
            run_child, sys.executable, "offline", [system, str(model_dir), file.name], env
        )
    finally:
        Path(file.name).unlink(missing_ok=True)
    runs: list[dict[str, Any]] = result["runs"]
    return runs


def _servers_phase(systems: dict[str, list[str]]) -> Phase:
    """Every system's server started, then their rows (systems: each one's) in turns."""

    async def phase(
        report: Report, model_dir: Path, work: Workload, sets: list[dict[str, Any]]
    ) -> None:
        async with contextlib.AsyncExitStack() as running:
            servers: list[Server] = []
            for index, system in enumerate(systems):
                # Each kvmesh stack on ports of its own.
                context: contextlib.AbstractAsyncContextManager[Server] = (
                    vllm_server(model_dir, report.device, report.dtype)
                    if system == "vllm"
                    else kvmesh_server(
                        model_dir, system, report.device, report.dtype, PORT_OFFSET + 100 * index
                    )
                )
                servers.append(await running.enter_async_context(context))
            report.servers = await server_rows(servers, systems, work, sets)

    return phase


async def _steps_phase(
    report: Report, model_dir: Path, work: Workload, sets: list[dict[str, Any]]
) -> None:
    report.steps = await asyncio.to_thread(run_child, sys.executable, "steps", [str(model_dir)], {})


# ---- agreement, table, plot ----------------------------------------------------------------


def compare(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Requests identical token for token, and the mean share of tokens before a divergence."""
    pairs = list(zip(a, b, strict=True))
    same = sum(x == y for x, y in pairs)
    prefix = [_common_prefix(x, y) / max(len(x), 1) for x, y in pairs]
    return {"identical": same, "requests": len(pairs), "agreeing_share": statistics.fmean(prefix)}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(report: Report) -> dict[str, Any]:
    """kvmesh against every other system, per row, over the runs both made (first runs), and
    vLLM against transformers offline (in a bfloat16 run: each against the float32 reference)."""
    found: dict[str, Any] = {}
    kv_off = report.offline.get("kvmesh")
    for other in ("vllm", "transformers"):
        if kv_off and other in report.offline:
            found[f"offline: kvmesh vs {other}"] = compare(
                kv_off[0]["outputs"], report.offline[other][0]["outputs"]
            )
    if "vllm" in report.offline and "transformers" in report.offline:
        found["offline: vllm vs transformers"] = compare(
            report.offline["vllm"][0]["outputs"], report.offline["transformers"][0]["outputs"]
        )
    kv_srv = report.servers.get("kvmesh colocated", {})
    for system, rows in report.servers.items():
        if system == "kvmesh colocated":
            continue
        for row, runs in rows.items():
            if row in kv_srv:
                found[f"{row}: kvmesh colocated vs {system}"] = compare(
                    kv_srv[row][0]["outputs"], runs[0]["outputs"]
                )
    return found


def best(runs: list[dict[str, Any]], key: str, higher: bool = True) -> float:
    """The better of a row's calm runs (all runs when none was calm)."""
    values = [r[key] for r in [r for r in runs if calm(r)] or runs]
    return max(values) if higher else min(values)


def table_rows(report: Report) -> list[tuple[str, str, str, str]]:
    """(workload, kvmesh, vLLM, kvmesh / vLLM) lines of the table; vLLM's cells read "not run"
    where it did not run."""
    lines = []
    off = report.offline
    if "kvmesh" in off:
        lines.append(_versus("offline, LLM.generate: output tok/s", off["kvmesh"], off.get("vllm")))
    if "transformers" in off and "kvmesh" in off:
        t = best(off["transformers"], "tok_s")
        lines.append(
            (
                f"offline, transformers generate() bs=8{_in_dtype(report)}: tok/s",
                "",
                f"{t:.1f} (transformers)",
                f"kvmesh {best(off['kvmesh'], 'tok_s') / t:.2f}x",
            )
        )
    srv = report.servers
    kv, vl = srv.get("kvmesh colocated", {}), srv.get("vllm", {})
    if "serving" in kv:
        k, v = kv["serving"], vl.get("serving")
        lines.append(_versus("serving, 32 concurrent: output tok/s", k, v))
        for key, label in (
            ("ttft_p50_ms", "TTFT p50 ms"),
            ("ttft_p99_ms", "TTFT p99 ms"),
            ("tpot_p50_ms", "TPOT p50 ms"),
        ):
            lines.append(_versus(f"serving, 32 concurrent: {label}", k, v, key))
    disagg = srv.get("kvmesh disaggregated", {})
    if "serving" in disagg:
        label = "serving, `kvmesh up` disaggregated: output tok/s"
        lines.append(_versus(label, disagg["serving"], vl.get("serving")))
    on_vllm = srv.get(KVMESH_ON_VLLM, {})
    if "serving" in on_vllm and "serving" in vl:
        o, v = on_vllm["serving"], vl["serving"]
        lines.append(_versus("serving, `kvmesh up --engine vllm` colocated: output tok/s", o, v))
        for key, label in (("ttft_p99_ms", "TTFT p99 ms"), ("tpot_p50_ms", "TPOT p50 ms")):
            lines.append(_versus(f"serving, `kvmesh up --engine vllm`: {label}", o, v, key))
    if "single" in kv:
        k, v = kv["single"], vl.get("single")
        lines.append(_versus("one request, 128 + 128: tok/s", k, v))
        lines.append(_versus("one request: TTFT ms", k, v, "ttft_ms"))
    if "prefix" in kv:
        for key, label in (("cold_ttft_ms", "cold"), ("warm_ttft_ms", "warm")):
            label = f"1,024-token prefix + 32: {label} TTFT ms"
            lines.append(_versus(label, kv["prefix"], vl.get("prefix"), key))
    return lines


def _in_dtype(report: Report) -> str:
    """ " in float32" where transformers ran in another dtype than the others, else ""."""
    dtype = reference_dtype(report.device, report.dtype)
    return "" if dtype == report.dtype else f" in {dtype}"


def _versus(
    label: str,
    ours: list[dict[str, Any]],
    theirs: list[dict[str, Any]] | None,
    key: str = "tok_s",
) -> tuple[str, str, str, str]:
    """One table line: the better run of each side (higher tok/s, lower times) and the ratio."""
    higher = key == "tok_s"
    digits = 1 if higher else 0
    a = best(ours, key, higher)
    if theirs is None:
        return (label, f"{a:.{digits}f}", "not run", "")
    b = best(theirs, key, higher)
    return (label, f"{a:.{digits}f}", f"{b:.{digits}f}", f"{a / b:.2f}x")


def step_lines(report: Report) -> list[str]:
    steps = report.steps
    if not steps:
        return []
    peak = steps["matmul_peak_flops"]
    lines = [
        f"- fp32 matmul peak measured here (2048^3, the faster of torch.mm and oneDNN, "
        f"{steps['threads']} threads): "
        f"{peak / 1e9:.0f} GFLOP/s."
    ]
    labels = {
        "prefill_512": "a 512-token prefill step",
        "decode_32": "a 32-row decode step (300-token contexts)",
    }
    for name, label in labels.items():
        seconds = steps["step_s"][name]
        rate = steps["step_flops"][name] / seconds
        lines.append(
            f"- kvmesh, {label}: {seconds * 1000:.1f} ms, {rate / 1e9:.0f} GFLOP/s = "
            f"{rate / peak:.0%} of the peak."
        )
    floor = steps["weight_bytes"] / steps["copy_bytes_per_s"]
    one = steps["step_s"]["decode_1"]
    lines.append(
        f"- kvmesh, the batch-1 step: {one * 1000:.1f} ms vs a {floor * 1000:.1f} ms weight-read "
        f"floor ({steps['weight_bytes'] / 1e6:.0f} MB at {steps['copy_bytes_per_s'] / 1e9:.1f} "
        f"GB/s copy bandwidth) = {one / floor:.2f}x."
    )
    lines.append(decode_read_floor_line(steps))
    default, onednn, plain = (steps["step_s_by_large_batch_linear"][m] for m in LARGE_BATCH_MODES)
    kernel_rows = steps["small_batch_max_rows"]
    larger = [name for name in default if steps["step_rows"][name] > kernel_rows]
    product = LARGE_PRODUCTS[steps["large_batch_product"]]
    crossover = steps.get("onednn_from_rows")
    if crossover is not None:
        product += f" (oneDNN from {crossover} rows, where it measured faster at start-up)"
    lines.append(
        f"- steps of more than {kernel_rows} row{'' if kernel_rows == 1 else 's'} (the "
        "small-batch kernel's float32 limit on this CPU), "
        f"their projections on {product} (the default) vs oneDNN on reordered weights / "
        "torch's matmul, side by side: "
        + ", ".join(
            f"{name} {default[name] / onednn[name]:.2f}x / {default[name] / plain[name]:.2f}x "
            "the time"
            for name in larger
        )
        + "."
    )
    prefetching, plain_panels = (
        steps["step_s_by_large_batch_linear"][m] for m in PANEL_PREFETCH_MODES
    )
    lines.append(
        "- the panel kernel asking for its next panel while it runs the current one vs not "
        f'("auto" prefetches on this CPU: {"yes" if steps["panel_prefetch"] else "no"}): '
        + ", ".join(
            f"{name} {prefetching[name] / plain_panels[name]:.2f}x the time" for name in larger
        )
        + "."
    )
    lines += serving_prefill_floor_lines(report)
    for system, runs in report.offline.items():
        rate = max(r["model_flops_per_s"] for r in runs)
        lines.append(
            f"- offline row, {system}: {rate / 1e9:.0f} GFLOP/s of model work over the run = "
            f"{rate / peak:.0%} of the peak."
        )
    return lines


def decode_read_floor_line(steps: dict[str, Any]) -> str:
    """The 32-row decode step against the bytes it reads: the weights once and each row's
    context of KV. At 32 rows that read, not the matmul peak, bounds the step."""
    rows = steps["step_rows"]["decode_32"]
    kv = rows * (steps["decode_context"] + 1) * steps["kv_bytes_per_token"]
    read = steps["weight_bytes"] + kv
    floor = read / steps["copy_bytes_per_s"]
    seconds = steps["step_s"]["decode_32"]
    return (
        f"- kvmesh, the 32-row decode step against what it reads: {read / 1e6:.0f} MB (the "
        f"weights once and {kv / 1e6:.0f} MB of its rows' KV), {floor * 1000:.1f} ms at the copy "
        f"bandwidth; the step takes {seconds / floor:.2f}x that."
    )


def serving_prefill_floor_lines(report: Report) -> list[str]:
    """The serving row's last first token against the work that must come before it: every
    prompt of the burst prefilled, at the measured peak and at the 512-token step's rate."""
    steps, work = report.steps, report.workload
    if "shapes" not in steps or "serving" not in report.servers.get("vllm", {}):
        return []
    requests, prompt = work["serving_requests"], work["serving_prompt"]
    flops = step_flops(Shapes(**steps["shapes"]), [(0, prompt)] * requests, logit_rows=requests)
    step_rate = steps["step_flops"]["prefill_512"] / steps["step_s"]["prefill_512"]
    at_peak, at_step = flops / steps["matmul_peak_flops"] * 1000, flops / step_rate * 1000
    p99 = {
        system: best(rows["serving"], "ttft_p99_ms", higher=False)
        for system, rows in report.servers.items()
        if "serving" in rows
    }
    goal = P99_TTFT_GOAL * p99["vllm"]
    return [
        f"- serving row, the last first token: before it, all {requests} prompts "
        f"({requests} x {prompt} tokens, {flops / 1e9:.0f} GFLOP) are prefilled, {at_peak:.0f} "
        f"ms at the peak and {at_step:.0f} ms at the 512-token step's rate; TTFT p99 "
        + ", ".join(f"{system} {ms:.0f} ms" for system, ms in p99.items())
        + f"; the goal's {P99_TTFT_GOAL}x of vLLM's is {goal:.0f} ms = "
        f"{goal / at_peak:.2f}x the time at the peak."
    ]


def serving_cpu_lines(report: Report) -> list[str]:
    """Per system, the cores each of its processes used in its first serving run."""
    lines = []
    for system, rows in report.servers.items():
        used = rows.get("serving", [{}])[0].get("region", {}).get("own_cores")
        if used:
            ranked = sorted(used.items(), key=lambda item: -item[1])
            lines.append(f"{system}: " + ", ".join(f"{name} {c:.2f}" for name, c in ranked))
    return lines


def disturbance_lines(report: Report) -> list[str]:
    lines = []
    for system, runs in report.offline.items():
        lines += [_region_line(f"offline {system}", r) for r in runs]
    for system, rows in report.servers.items():
        for row, runs in rows.items():
            lines += [_region_line(f"{row} {system}", r) for r in runs]
    return lines


def _region_line(name: str, run: dict[str, Any]) -> str:
    region = run["region"]
    if "repeat_of_disturbed" in run:
        name += f" (repeat of run {run['repeat_of_disturbed'] + 1})"
    mark = " **disturbed**" if is_disturbed(region) else ""
    mark += " **slow host**" if run.get("slow_host") else ""
    machine = run.get("machine")
    probed = (
        f"; the machine just before: {machine['matmul_gflops']:.0f} GFLOP/s, "
        f"{machine['copy_gb_s']:.1f} GB/s copy"
        if machine
        else ""
    )
    return (
        f"{name}: {region['seconds']:.1f} s, load {region['load_start']:.1f} -> "
        f"{region['load_end']:.1f}, other processes {region['other_cores']:.2f} cores{mark}"
        f"{probed}"
    )


def markdown(report: Report, command: str) -> str:
    m = report.machine
    model = (
        MODEL
        if report.model == MODEL
        else f"{report.model} (a Qwen2 model of {MODEL}'s shapes, random weights)"
    )
    name = results_name(report.model, report.device, report.dtype)
    lines = [
        heading_of(report.model, report.device, report.dtype),
        "",
        f"`{command}` — {model} in {report.dtype} from one Hugging Face folder written "
        f"by kvmesh's loader, the same prompt token ids for every system, on {_where(m)}; load "
        f"average {m['load_average_start']:.1f} at the start, {m['load_average_end']:.1f} at "
        f"the end. {_vllm_setup(report)}; kvmesh with its defaults{_but_dtype(report)} "
        "(`kvmesh up --mode colocated` for the server rows). One warm-up each, then "
        f"{report.workload['runs']} "
        "run(s) per row on fresh prompts, the systems taking turns on each row (in the "
        "opposite order on every other run): the servers up together, each run once the machine "
        "settled; offline, a child process with its own warm-up for each run of each library. "
        "Each figure is the better calm run (neither disturbed nor on a slow host). Results: "
        f"`bench/results/{name}.json`, `bench/results/{name}.png`.",
        "",
        f"| workload | kvmesh | {_peer_name(report)} | kvmesh / vLLM |",
        "|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in table_rows(report)]
    lines += ["", "Greedy outputs, token by token:", ""]
    for name, agree in report.agreement.items():
        lines.append(
            f"- {name}: {agree['identical']} of {agree['requests']} requests identical; on average "
            f"{agree['agreeing_share']:.0%} of each output agrees before any divergence."
        )
    for system, rows in report.servers.items():
        for run in rows.get("serving", []):
            if run.get("incomplete"):
                lines.append(
                    f"- {system}, serving: {len(run['incomplete'])} answers incomplete: "
                    + "; ".join(run["incomplete"])
                )
    steps = step_lines(report)
    if steps:
        lines += ["", "Against the machine:", "", *steps]
    serving_cpu = serving_cpu_lines(report)
    if serving_cpu:
        lines += ["", "Cores used on the serving row, by process (the client is bench.peers):", ""]
        lines += [f"- {line}" for line in serving_cpu]
    lines += [
        "",
        f"Timed regions (a region where other processes and the hypervisor (steal) took over "
        f"{DISTURBED_CORES} cores is disturbed, one whose probe just before it read under "
        f"{SLOW_HOST_SHARE:.0%} of the fastest probe before it in its phase is on a slow "
        "host; either was run again on fresh prompts, and a row's figure comes from its other "
        "runs where it has any; each with the machine probed just before it):",
        "",
    ]
    lines += [f"- {line}" for line in disturbance_lines(report)]
    return "\n".join(lines) + "\n"


def _but_dtype(report: Report) -> str:
    """ " but --dtype D" where the run chose another dtype than the device's default, else ""."""
    return "" if report.dtype == DTYPES[report.device] else f" but `--dtype {report.dtype}`"


def _where(m: dict[str, Any]) -> str:
    """The machine the figures came from, as the section says it."""
    if m.get("gpu"):
        return f"{m['gpu']} (host {m['cpu']}, {m['cores']} cores)"
    isa = "AVX2 (no AVX-512)"
    if m["avx512"]:
        isa = "AVX-512 + BF16" if m["avx512_bf16"] else "AVX-512"
    return f"{m['cpu']} ({m['cores']} cores, {isa})"


def _peer_name(report: Report) -> str:
    return "vLLM CPU" if report.device == "cpu" else "vLLM"


def _vllm_ran(report: Report) -> bool:
    return "vllm" in report.offline or "vllm" in report.servers


def _vllm_setup(report: Report) -> str:
    """How vLLM ran, or that it did not."""
    if not _vllm_ran(report):
        return "vLLM not run (--skip-vllm: not installed where this ran)"
    if report.device != "cpu":
        return f"vLLM {_vllm_version()} (the `vllm` package with its defaults)"
    setup = (
        f"vLLM {_vllm_version()} (compiled by inductor, VLLM_CPU_OMP_THREADS_BIND over every "
        "core, VLLM_CPU_KVCACHE_SPACE set, tcmalloc preloaded where installed)"
    )
    if KVMESH_ON_VLLM not in report.servers:
        return setup
    return (
        f"{setup}; `kvmesh up --engine vllm` is the same mesh on vLLM's engine (compiled, "
        "threads on every core, vLLM's environment and its server's batch limits, "
        "--max-num-batched-tokens 2048 --max-num-seqs 128)"
    )


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-cpu")
    except PackageNotFoundError:
        return version("vllm")


def plot(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Every line with a ratio: kvmesh / vLLM, and kvmesh / transformers on the offline row.
    rows = [r for r in table_rows(report) if r[3]]
    names = [f"{r[0]} (kvmesh / it)" if r[3].startswith("kvmesh") else r[0] for r in rows]
    ratios = [float(r[3].split()[-1].rstrip("x")) for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    colors = [
        "tab:green" if ("tok/s" in n) == (x >= 1) else "tab:red"
        for n, x in zip(names, ratios, strict=True)
    ]
    ax.barh(names, ratios, color=colors)
    ax.axvline(1.0, color="black", linewidth=0.8)
    peer = _peer_name(report)
    ax.set_xlabel(f"kvmesh / {peer} (tok/s: higher is better; ms: lower is better)")
    ax.invert_yaxis()
    absent = "" if _vllm_ran(report) else " (not run)"
    ax.set_title(f"kvmesh vs {peer}{absent}\n{_where(report.machine)}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- entry points --------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small rows, one run each")
    parser.add_argument(
        "--rows",
        nargs="+",
        default=["offline", "serving", "single", "prefix", "steps"],
        choices=["offline", "serving", "single", "prefix", "steps"],
    )
    parser.add_argument(
        "--offline-systems",
        nargs="+",
        default=["kvmesh", "vllm", "transformers"],
        choices=["kvmesh", "vllm", "transformers"],
    )
    parser.add_argument("--model", choices=MODELS, default=MODEL, help="the weights to run")
    parser.add_argument(
        "--device",
        choices=tuple(DTYPES),
        default="cpu",
        help="where every system runs, in float32 on the CPU or bfloat16 on the GPU",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="what kvmesh and vLLM run in (default: float32 on the CPU, bfloat16 on a GPU); "
        "transformers stays in float32 on the CPU, the reference for the greedy tokens",
    )
    parser.add_argument(
        "--skip-vllm",
        action="store_true",
        help="leave vLLM out where it is not installed (its figures read 'not run')",
    )
    parser.add_argument("--skip-disaggregated", action="store_true")
    parser.add_argument(
        "--skip-kvmesh-vllm",
        action="store_true",
        help="leave out `kvmesh up --engine vllm` on the serving row",
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("child_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or DTYPES[args.device]
    return args


def child(args: argparse.Namespace) -> None:
    if args.child == "offline":
        system, model_dir, spec_path = args.child_args
        result = offline_child(system, model_dir, json.loads(Path(spec_path).read_text()))
    else:
        result = steps_child(args.child_args[0])
    Path(args.result).write_text(json.dumps(result))


def command_line(args: argparse.Namespace) -> str:
    python = ".venv-vllm/bin/python" if args.device == "cpu" else "python3"
    parts = (
        ["make bench-peers"] if not sys.argv[1:] else [f"{python} -m bench.peers", *sys.argv[1:]]
    )
    return " ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    if shutil.which("lscpu") is None:
        raise SystemExit("lscpu is needed to say which CPU the figures came from")
    console = Console()
    report = asyncio.run(run(args, console))
    section = markdown(report, command_line(args))
    console.print(section)
    if not args.no_write:
        name = results_name(args.model, args.device, args.dtype)
        write_results(name, asdict(report))
        plot(report, RESULTS / f"{name}.png")
        write_section(section, BENCHMARKS)
        console.print(
            f"wrote {RESULTS}/{name}.json, {RESULTS}/{name}.png and "
            f"{heading_of(args.model, args.device, args.dtype)!r} in {BENCHMARKS}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
