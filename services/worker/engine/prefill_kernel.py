"""The paged prefill-attention kernel (kernels/paged_prefill_attention.c): loaded and called.

On CPU, torch attends a prefill chunk with its flash attention over contiguous K/V: a chunk
after a cached prefix needs the prefix gathered out of its blocks and a second call merged by
log-sum-exps, and with a sliding window a [chunk, context] mask. The C kernel reads the whole
context (prefix and the chunk's own K/V, already written) through the block table, with the
causal limit and the window computed, not read from a mask; the query heads sharing a KV head
are one tile's rows. Measured against torch's flash attention on one 1,024-token chunk of the
default model's shape (9 query heads, 3 KV heads, head_dim 64; AMD EPYC Zen 4, 2 threads):
9.2-10.0 against 14.2-15.2 ms. A bfloat16 model's cache is read by a build of its own
(KV_BFLOAT16: each K/V element widened as it is packed): SmolLM2-135M's 1,056-token prefill step
in bfloat16 on the same CPU, 865 against 999 ms with torch's bfloat16 flash attention, 512
tokens 384 against 462. kernel_build.py compiles and caches it.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from services.worker.engine.kernel_build import KV_BUILDS, choose_kernel, load_library, profiled

_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64


class PrefillKernel:
    """Causal attention of one prefill chunk over one layer's paged K/V."""

    def __init__(self, library: ctypes.CDLL, num_threads: int) -> None:
        self.function = library.paged_prefill_attention
        self.function.restype = ctypes.c_int
        self.function.argtypes = (
            [_POINTER] + [_INT] + [_POINTER] * 4 + [_INT] * 7 + [ctypes.c_float, ctypes.c_int]
        )
        self.num_threads = num_threads

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
        built for (the runner builds them); ctypes cannot check. q may be of the caches' dtype:
        it is computed in float32, and the output comes back in q's dtype."""
        dtype = q.dtype
        if dtype != torch.float32:
            q = q.float()
        elif q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            q = q.contiguous()
        chunk, heads, head_dim = q.shape
        table = block_table.contiguous()  # held: the kernel reads it by address
        out = torch.empty((chunk, heads, head_dim), dtype=torch.float32)
        with profiled("kvmesh::paged_prefill_attention"):
            status = self.function(
                q.data_ptr(),
                q.stride(0),
                key_blocks.data_ptr(),
                value_blocks.data_ptr(),
                table.data_ptr(),
                out.data_ptr(),
                chunk,
                prefix_len,
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
        return out.to(dtype)


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
def load_prefill_kernel(num_threads: int, dtype: torch.dtype = torch.float32) -> PrefillKernel:
    """The kernel for a cache of `dtype`, compiled on first use (KernelUnavailable when it
    cannot be)."""
    return PrefillKernel(load_library("paged_prefill_attention", KV_BUILDS[dtype]), num_threads)
