"""The engine's C kernels (kernels/*.c): compiled on first use, cached, loaded, chosen.

Each kernel is compiled with the machine's C compiler the first time it is needed and cached
under ~/.cache/kvmesh/kernels, keyed by the source (with the headers in kernels/), the flags,
the compiler and the CPU, since it is built for this CPU (-march=native). Without a compiler
the engine keeps torch's path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)

KERNELS_DIR = Path(__file__).with_name("kernels")
# -fno-math-errno lets sqrtf inline; glibc's expf stays a call per element without
# -ffast-math, so the kernels take e^x from kernels/exp_approx.h. -fno-trapping-math lets GCC
# turn exp_approx's clamps (and the softmax's masks) into vector selects: with traps kept, the
# compares are control flow and every loop calling exp_approx ran one float at a time (the
# SwiGLU, both attention kernels' softmax). No -ffast-math: its start-up code would flip the
# whole process's floating-point flags, and it would reorder the sums.
# -mprefer-vector-width=512: GCC's tuning for Intel CPUs vectorizes plain loops (`#pragma omp
# simd`: the attention kernels' softmax, RMSNorm, SwiGLU, RoPE) 256 bits wide even where the
# kernels' own vector types are 512 bits wide. On 2 cores of an Intel Xeon (family 6 model 167),
# alternated: SmolLM2-135M's 1,056-token prefill attention 141 vs 160 ms (30 layers), the
# batch-1 step 20.2-20.3 vs 22.2-22.5 ms, the 1,056-token step 812-836 vs 837-868 ms. GCC 12
# tunes an AMD EPYC Zen 4 as a Zen 3, 256 bits wide too; there the 1,056-token step took
# 1,296-1,321 vs 1,315-1,330 ms, three runs each alternated. It is an x86 flag, and changes
# nothing on a CPU without AVX-512.
CFLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
) + (("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ())

Kernel = TypeVar("Kernel")

# The build of a kernel reading or writing the KV cache (paged_decode_attention.c,
# paged_prefill_attention.c, rope_and_store.c; kernels/kv_element.h) for each cache dtype: the
# macros it is compiled with.
KV_BUILDS: dict[torch.dtype, tuple[str, ...]] = {
    torch.float32: (),
    torch.bfloat16: ("KV_BFLOAT16",),
}


class KernelUnavailable(RuntimeError):
    """A kernel cannot be built or loaded here (no C compiler, or it failed)."""


def kernel_applies(
    device: torch.device, dtype: torch.dtype, dtypes: tuple[torch.dtype, ...] = (torch.float32,)
) -> bool:
    """The kernels are written for tensors in CPU memory, of float32 (or of `dtypes`, the ones a
    kernel is built for)."""
    return device.type == "cpu" and dtype in dtypes


def choose_kernel(
    mode: str,
    fallback: str,
    device: torch.device,
    dtype: torch.dtype,
    load: Callable[[], Kernel],
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
) -> Kernel | None:
    """The kernel for an EngineConfig mode, or None for torch's path (named `fallback`);
    `dtypes`: the model dtypes the kernel is built for.

    "kernel" insists (ValueError / KernelUnavailable when it cannot run); "auto" falls back
    with a warning when the kernel cannot be built; `fallback` means torch's path."""
    if mode == fallback:
        return None
    if not kernel_applies(device, dtype, dtypes):
        if mode == "kernel":
            names = " and ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"this kernel runs on CPU {names} only, not {device} {dtype}")
        return None
    try:
        return load()
    except KernelUnavailable as exc:
        if mode == "kernel":
            raise
        logger.warning("falls back to %s: %s", fallback, exc)
        return None


def profiled(name: str) -> contextlib.AbstractContextManager[object]:
    """A kernel call named for torch.profiler, which cannot see into a foreign call; a no-op
    unless a profiler runs (record_function costs ~7 us a call, 0.2 ms of a batch-1 decode
    step over 30 layers)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def load_library(name: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """kernels/<name>.c as a loaded library, compiled on first use (KernelUnavailable when it
    cannot be)."""
    return ctypes.CDLL(str(build(name, defines)))


def build(name: str, defines: tuple[str, ...] = ()) -> Path:
    """The cached shared library of kernels/<name>.c, compiled if not cached yet; `defines`
    (macro names, each passed as -D) build a variant of it, a library of its own."""
    source = KERNELS_DIR / f"{name}.c"
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc, or $CC) on PATH")
    version = _run([compiler, "--version"])
    key = hashlib.sha256()
    # The headers the kernels share are part of every kernel's source.
    headers = [header.read_bytes() for header in sorted(KERNELS_DIR.glob("*.h"))]
    for part in (
        source.read_bytes(),
        *headers,
        " ".join((*CFLAGS, *defines)).encode(),
        version.encode(),
        _cpu_id(),
    ):
        key.update(part)
    variant = "".join(f"-{define.lower()}" for define in defines)
    target = _cache_dir() / f"{name}{variant}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        logger.info(
            "compiling the %s kernel for this CPU (once per machine, a few seconds; cached in %s)",
            name,
            target.parent,
        )
        # Compiled beside the target, then renamed: processes starting together never load a
        # half-written library.
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            flags = [*CFLAGS, *(f"-D{define}" for define in defines)]
            _run([compiler, *flags, str(source), "-o", str(built), "-lm"])
            built.replace(target)
        logger.info("compiled the %s kernel into %s", name, target)
    return target


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvmesh" / "kernels"


def _cpu_id() -> bytes:
    """What -march=native depends on: the CPU's model and feature flags."""
    lines = _cpuinfo_lines()
    if not lines:
        return platform.processor().encode()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(wanted))).encode()


@functools.cache
def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"), or "" where it has none."""
    return _cpuinfo_field("vendor_id")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """/proc/cpuinfo's feature flags ("avx512f", "amx_bf16", ...), empty where it has none."""
    return frozenset(_cpuinfo_field("flags").split())


def cpu_has_amx() -> bool:
    """Whether the CPU multiplies bfloat16 on AMX tiles (the kernels' AMX_TILES builds, and
    the step budget of a bfloat16 model: config.AMX_BFLOAT16_STEP_TOKENS)."""
    return "amx_bf16" in cpu_flags()


def _cpuinfo_field(name: str) -> str:
    """The value of /proc/cpuinfo's first `name` line, or ""."""
    for line in _cpuinfo_lines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _run(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"{command[0]} failed: {exc}") from exc
    if done.returncode != 0:
        raise KernelUnavailable(f"{' '.join(command)} failed:\n{done.stderr.strip()}")
    return done.stdout
