"""The paged prefill-attention kernel (kernels/paged_prefill_attention.c): loaded and called.

On CPU, torch attends a prefill chunk with its flash attention over contiguous K/V: a chunk
after a cached prefix needs the prefix gathered out of its blocks and a second call merged by
log-sum-exps, and with a sliding window a [chunk, context] mask. The C kernel reads the whole
context (prefix and the chunk's own K/V, already written) through the block table, with the
causal limit and the window computed, not read from a mask; the query heads sharing a KV head
are one tile's rows. Measured against torch's flash attention on one 1,024-token chunk of the
default model's shape (9 query heads, 3 KV heads, head_dim 64; AMD EPYC Zen 4, 2 threads):
9.2-10.0 against 14.2-15.2 ms. A bfloat16 model's cache is read by a build of its own
(KV_BFLOAT16: each K/V and query element widened as it is packed, the output rounded once):
SmolLM2-135M's 1,056-token prefill step in bfloat16 on the same CPU, 865 against 999 ms with
torch's bfloat16 flash attention, 512 tokens 384 against 462. On AMD its BFLOAT16_PAIRS build
multiplies bfloat16 pairs instead (BFLOAT16_PAIRS_VENDORS), and where the CPU has AMX its
AMX_TILES build multiplies them on AMX tiles (on an Intel Xeon with AMX, a 1,056-token
bfloat16 prefill step 0.79x the widening build's time, 32 tokens after a 1,024-token prefix
0.81-0.82x). kernel_build.py compiles and caches it.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging

import torch

from services.worker.engine.kernel_build import (
    KV_BUILDS,
    KernelUnavailable,
    choose_kernel,
    cpu_has_amx,
    cpu_vendor,
    load_library,
    profiled,
)

logger = logging.getLogger(__name__)

_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64
# The CPUs, by vendor, on which a bfloat16 cache's build multiplies bfloat16 pairs (its
# BFLOAT16_PAIRS build: vdpbf16ps, where the CPU has AVX-512 BF16) instead of widening every
# key, value and query to float32. SmolLM2-135M's whole steps on 2 cores of an AMD EPYC Zen 4,
# both builds alternated in one process, min of 9, two runs: a 1,056-token prefill 0.89-0.90x
# the time, 32 tokens after a 1,024-token prefix 0.80-0.82x, 8 chunks of 128 tokens
# 0.96-0.99x, one of 128 a tie. Not Intel: on the Xeon (family 6 model 207) vdpbf16ps did no
# more products a cycle than float32's FMAs (linear_kernel.BFLOAT16_FMA_VENDORS), and on the
# model 167 (with AMX) the pairs build on vectors took 1.25x the widening build's time for a
# 1,056-token prefill step; where the CPU has AMX the pairs go on its tiles instead
# (load_prefill_kernel's tiles), on any vendor.
BFLOAT16_PAIRS_VENDORS = frozenset({"AuthenticAMD"})


class PrefillKernel:
    """Causal attention of prefill chunks over one layer's paged K/V."""

    def __init__(self, library: ctypes.CDLL, num_threads: int) -> None:
        self.function = library.paged_prefill_attention
        """One chunk's attention: decode_layers.c calls it by its address."""
        self.num_threads = num_threads
        self.chunks_function = library.paged_prefill_attention_chunks
        self.chunks_function.restype = ctypes.c_int
        self.chunks_function.argtypes = (
            *(_INT, _POINTER, _INT),  # count, q, q row stride
            *(_POINTER,) * 6,  # starts, prefix lengths, tables, key/value caches, out
            *(_INT,) * 5,  # heads, kv heads, head_dim, block size, window
            *(ctypes.c_float, ctypes.c_int),
        )
        library.paged_prefill_attention_pairs.restype = ctypes.c_int
        self.pairs = bool(library.paged_prefill_attention_pairs())
        """Whether it multiplies bfloat16 pairs (the BFLOAT16_PAIRS build on AVX-512 BF16)."""
        library.paged_prefill_attention_tiles.restype = ctypes.c_int
        tiles = library.paged_prefill_attention_tiles()
        if tiles < 0:
            raise KernelUnavailable("Linux refused this process AMX's tile registers")
        self.tiles = tiles == 1
        """Whether it multiplies on AMX tiles (the AMX_TILES build where the CPU has AMX)."""

    def __call__(
        self,
        q: torch.Tensor,
        key_blocks: torch.Tensor,
        value_blocks: torch.Tensor,
        block_table: torch.Tensor,
        prefix_len: int,
        window: int = 0,
    ) -> torch.Tensor:
        """q [chunk, heads, dim] (rows may be strided); key/value_blocks [blocks, block_size,
        kv_heads, dim] holding the chunk's own K/V already; block_table [>= ceil(context /
        block_size)] int64 -> [chunk, heads, dim]. Query i sits at position prefix_len + i;
        window > 0: it attends to its last `window` positions only (a sliding window).

        The caller guarantees the shapes and that the caches are of the dtype the kernel was
        built for (the runner builds them); ctypes cannot check. q is read, and the output
        written, in the caches' dtype (q converted first where it is not)."""
        return self.chunks(
            q, key_blocks, value_blocks, [q.shape[0]], [prefix_len], [block_table], window
        )

    def chunks(
        self,
        q: torch.Tensor,
        key_blocks: torch.Tensor,
        value_blocks: torch.Tensor,
        lengths: list[int],
        prefix_lens: list[int],
        block_tables: list[torch.Tensor],
        window: int = 0,
    ) -> torch.Tensor:
        """Several chunks of one step in one call, as __call__ on each: q [rows, heads, dim]
        holds them one after another (lengths[i] rows each, rows may be strided), chunk i
        after prefix_lens[i] cached tokens, read through block_tables[i] -> [rows, heads,
        dim]. One parallel region for all: SmolLM2-135M's step of eight 128-token prompts
        (the serving row's burst) called it 240 times a step, one chunk at a time."""
        q = q.to(key_blocks.dtype)
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            q = q.contiguous()
        count = len(lengths)
        rows, heads, head_dim = q.shape
        tables = [table.contiguous() for table in block_tables]  # held: read by address
        starts = (ctypes.c_int64 * (count + 1))(0, *itertools.accumulate(lengths))
        out = torch.empty((rows, heads, head_dim), dtype=key_blocks.dtype)
        with profiled("kvmesh::paged_prefill_attention"):
            status = self.chunks_function(
                count,
                q.data_ptr(),
                q.stride(0),
                starts,
                (ctypes.c_int64 * count)(*prefix_lens),
                (ctypes.c_void_p * count)(*(table.data_ptr() for table in tables)),
                key_blocks.data_ptr(),
                value_blocks.data_ptr(),
                out.data_ptr(),
                heads,
                key_blocks.shape[2],
                head_dim,
                key_blocks.shape[1],
                window,
                head_dim**-0.5,
                self.num_threads,
            )
        if status != 0:
            raise MemoryError("the prefill-attention kernel could not allocate its scratch memory")
        return out


def choose_prefill_kernel(
    mode: str, device: torch.device, dtype: torch.dtype, num_threads: int
) -> PrefillKernel | None:
    """The kernel for EngineConfig.prefill_attention ("auto" | "kernel" | "sdpa") and a cache
    of `dtype` (float32 or bfloat16), or None for torch's flash attention (see
    kernel_build.choose_kernel)."""
    return choose_kernel(
        mode,
        "sdpa",
        device,
        dtype,
        lambda: load_prefill_kernel(num_threads, dtype),
        dtypes=tuple(KV_BUILDS),
    )


@functools.cache
def load_prefill_kernel(
    num_threads: int,
    dtype: torch.dtype = torch.float32,
    pairs: bool | None = None,
    tiles: bool | None = None,
) -> PrefillKernel:
    """The kernel for a cache of `dtype`, compiled on first use (KernelUnavailable when it
    cannot be). For a bfloat16 cache: pairs, its BFLOAT16_PAIRS build (it multiplies pairs
    only where the CPU has AVX-512 BF16: PrefillKernel.pairs), None by this CPU's vendor
    (BFLOAT16_PAIRS_VENDORS) or where tiles are taken; tiles, its AMX_TILES build, which
    multiplies the pairs on AMX tiles where the CPU has them (PrefillKernel.tiles), None
    where the CPU has AMX-BF16 and Linux grants this process the tiles, unless pairs is
    False."""
    if dtype != torch.bfloat16:
        return PrefillKernel(load_library("paged_prefill_attention", KV_BUILDS[dtype]), num_threads)
    if tiles is None:
        if pairs is not False and cpu_has_amx():
            try:
                return load_prefill_kernel(num_threads, dtype, pairs, tiles=True)
            except KernelUnavailable as exc:
                logger.warning("prefill attention without AMX tiles: %s", exc)
        tiles = False
    if pairs is None:
        pairs = tiles or cpu_vendor() in BFLOAT16_PAIRS_VENDORS
    if tiles and not pairs:
        raise ValueError("the AMX_TILES build multiplies bfloat16 pairs: pairs cannot be False")
    builds = [*KV_BUILDS[dtype]]
    if pairs:
        builds.append("BFLOAT16_PAIRS")
    if tiles:
        builds.append("AMX_TILES")
    return PrefillKernel(load_library("paged_prefill_attention", tuple(builds)), num_threads)
