"""The paged decode-attention kernel (kernels/paged_decode_attention.c): loaded and called.

On CPU, attending decode rows through torch means gathering each row's blocks into a padded
tensor and running a masked SDPA over it: the context is read twice, written once, and padded.
The C kernel reads each row's real K/V once, straight through its block table (measured 3-4x
less time per decode step's attention on 2 cores, 64 rows of 64-640 tokens). kernel_build.py
compiles and caches it. A bfloat16 model's cache is read by a build of its own (KV_BFLOAT16),
which widens each K/V element to float32 as it loads it: its queries and outputs stay float32
inside the call.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from services.worker.engine.kernel_build import KV_BUILDS, choose_kernel, load_library, profiled

_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64


class DecodeKernel:
    """Decode attention of many single-token rows over one layer's paged K/V."""

    def __init__(self, library: ctypes.CDLL, num_threads: int) -> None:
        self.function = library.paged_decode_attention
        self.function.restype = ctypes.c_int
        self.function.argtypes = [_POINTER] * 6 + [_INT] * 7 + [ctypes.c_float, ctypes.c_int]
        self.num_threads = num_threads

    def __call__(
        self,
        q: torch.Tensor,
        key_blocks: torch.Tensor,
        value_blocks: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        window: int = 0,
    ) -> torch.Tensor:
        """q [rows, heads, dim]; key/value_blocks [blocks, block_size, kv_heads, dim];
        block_tables [rows, max_blocks] int64; context_lens [rows] int64 -> [rows, heads, dim].
        window > 0: each row attends to its last `window` tokens only (a sliding window).

        The caller guarantees the shapes and that the caches are of the dtype the kernel was
        built for (the runner builds them); ctypes cannot check. q may be of the caches' dtype:
        it is computed in float32, and the output comes back in q's dtype."""
        dtype = q.dtype
        q = q.float().contiguous()
        out = torch.empty_like(q)
        rows, heads, head_dim = q.shape
        with profiled("kvmesh::paged_decode_attention"):
            status = self.function(
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
                window,
                head_dim**-0.5,
                self.num_threads,
            )
        if status != 0:
            raise MemoryError("the decode-attention kernel could not allocate its scratch memory")
        return out.to(dtype)


def choose_decode_kernel(
    mode: str, device: torch.device, dtype: torch.dtype, num_threads: int
) -> DecodeKernel | None:
    """The kernel for EngineConfig.decode_attention ("auto" | "kernel" | "sdpa") and a cache of
    `dtype` (float32 or bfloat16), or None for the SDPA path (see kernel_build.choose_kernel)."""
    return choose_kernel(
        mode,
        "sdpa",
        device,
        dtype,
        lambda: load_decode_kernel(num_threads, dtype),
        dtypes=tuple(KV_BUILDS),
    )


@functools.cache
def load_decode_kernel(num_threads: int, dtype: torch.dtype = torch.float32) -> DecodeKernel:
    """The kernel for a cache of `dtype`, compiled on first use (KernelUnavailable when it
    cannot be)."""
    return DecodeKernel(load_library("paged_decode_attention", KV_BUILDS[dtype]), num_threads)
