"""The paged decode-attention kernel (kernels/paged_decode_attention.c): built, loaded, called.

On CPU, attending decode rows through torch means gathering each row's blocks into a padded
tensor and running a masked SDPA over it: the context is read twice, written once, and padded.
The C kernel reads each row's real K/V once, straight through its block table (measured 3-4x
less time per decode step's attention on 2 cores, 64 rows of 64-640 tokens).

The kernel is compiled with the machine's C compiler the first time it is needed and cached
under ~/.cache/kvmesh/kernels, keyed by the source, the flags, the compiler and the CPU, since
it is built for this CPU (-march=native). Without a compiler the engine keeps the SDPA path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "paged_decode_attention.c"
# -fno-math-errno lets expf vectorize; no -ffast-math, whose start-up code would flip the
# whole process's floating-point flags.
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")

_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here (no C compiler, or it failed)."""


class DecodeKernel:
    """Decode attention of many single-token rows over one layer's paged K/V."""

    def __init__(self, library: ctypes.CDLL, num_threads: int) -> None:
        self._function = library.paged_decode_attention
        self._function.restype = ctypes.c_int
        self._function.argtypes = [_POINTER] * 6 + [_INT] * 6 + [ctypes.c_float, ctypes.c_int]
        self.num_threads = num_threads

    def __call__(
        self,
        q: torch.Tensor,
        key_blocks: torch.Tensor,
        value_blocks: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """q [rows, heads, dim]; key/value_blocks [blocks, block_size, kv_heads, dim];
        block_tables [rows, max_blocks] int64; context_lens [rows] int64 -> [rows, heads, dim].

        The caller guarantees the shapes (the runner builds them); ctypes cannot check."""
        q = q.contiguous()
        out = torch.empty_like(q)
        rows, heads, head_dim = q.shape
        # Named for torch.profiler, which cannot see into a foreign call (costs ~1 us).
        with torch.profiler.record_function("kvmesh::paged_decode_attention"):
            status = self._function(
                q.data_ptr(),
                key_blocks.data_ptr(),
                value_blocks.data_ptr(),
                block_tables.data_ptr(),
                context_lens.data_ptr(),
                out.data_ptr(),
                rows,
                heads,
                key_blocks.shape[2],
                head_dim,
                key_blocks.shape[1],
                block_tables.shape[1],
                head_dim**-0.5,
                self.num_threads,
            )
        if status != 0:
            raise MemoryError("the decode-attention kernel could not allocate its scratch memory")
        return out


def kernel_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """The kernel is written for float32 tensors in CPU memory."""
    return device.type == "cpu" and dtype == torch.float32


def choose_decode_kernel(
    mode: str, device: torch.device, dtype: torch.dtype, num_threads: int
) -> DecodeKernel | None:
    """The kernel for EngineConfig.decode_attention, or None for the SDPA path.

    "kernel" insists (ValueError / KernelUnavailable when it cannot run); "auto" falls back to
    SDPA with a warning when the kernel cannot be built."""
    if mode == "sdpa":
        return None
    if not kernel_applies(device, dtype):
        if mode == "kernel":
            raise ValueError(f"the decode kernel runs on CPU float32 only, not {device} {dtype}")
        return None
    try:
        return load_decode_kernel(num_threads)
    except KernelUnavailable as exc:
        if mode == "kernel":
            raise
        logger.warning("decode attention falls back to SDPA: %s", exc)
        return None


@functools.cache
def load_decode_kernel(num_threads: int) -> DecodeKernel:
    """The kernel, compiled on first use (KernelUnavailable when it cannot be)."""
    return DecodeKernel(ctypes.CDLL(str(_build())), num_threads)


def _build() -> Path:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc, or $CC) on PATH")
    version = _run([compiler, "--version"])
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), version.encode(), _cpu_id()):
        key.update(part)
    target = _cache_dir() / f"paged_decode_attention-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Compiled beside the target, then renamed: processes starting together never load a
        # half-written library.
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            _run([compiler, *CFLAGS, str(SOURCE), "-o", str(built), "-lm"])
            built.replace(target)
        logger.info("compiled the decode-attention kernel into %s", target)
    return target


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvmesh" / "kernels"


def _cpu_id() -> bytes:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(wanted))).encode()


def _run(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"{command[0]} failed: {exc}") from exc
    if done.returncode != 0:
        raise KernelUnavailable(f"{' '.join(command)} failed:\n{done.stderr.strip()}")
    return done.stdout
