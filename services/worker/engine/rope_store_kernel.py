"""The rotary-embedding and KV-store kernel (kernels/rope_and_store.c): loaded and called.

Each layer rotates its new Q/K heads and writes the new K/V into the paged cache. In torch
that is six small ops for the rotation (a complex product through views, and a copy back) and
two index_copy_ calls: at batch sizes of decoding, each costs more in dispatch than in
arithmetic, 30 times a step. The kernel does both in one pass over the fused Q/K/V rows,
rotating them in place, each result within one step of its dtype of torch's (it may fuse a
product and a sum into one multiply-add where torch rounds the product first). kernel_build.py
compiles and caches it; a bfloat16 model's Q/K/V and cache take a build of their own
(KV_BFLOAT16), which rotates each pair in float32 and rounds it once back, as torch's path does.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from services.worker.engine.kernel_build import KV_BUILDS, choose_kernel, load_library

_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64


class RopeStoreKernel:
    """RoPE on a step's Q/K heads in place, and its K/V into one layer's cache slots."""

    def __init__(self, library: ctypes.CDLL, num_threads: int) -> None:
        self.function = library.rope_and_store
        self.function.restype = None
        self.function.argtypes = [_POINTER] + [_INT] * 5 + [_POINTER] * 4 + [ctypes.c_int]
        self.num_threads = num_threads

    def __call__(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        rotations: torch.Tensor,
        slots: torch.Tensor,
        key_slots: torch.Tensor,
        value_slots: torch.Tensor,
    ) -> None:
        """qkv [T, heads + 2 * kv_heads, dim] contiguous, rotated in place (its Q and K heads,
        rotary pairs adjacent); rotations [T, 1, dim / 2] complex (each token's position);
        slots [T] int64; key/value_slots [slots, kv_heads, dim] contiguous get row t's K and V
        at slots[t].

        The caller guarantees the shapes and that qkv and the slots are of the dtype the kernel
        was built for (the layer builds them); ctypes cannot check."""
        pairs = torch.view_as_real(rotations)  # [T, 1, dim / 2, 2], (cos, sin)
        tokens, width, head_dim = qkv.shape
        self.function(
            qkv.data_ptr(),
            tokens,
            width * head_dim,
            num_heads,
            key_slots.shape[1],
            head_dim,
            pairs.data_ptr(),
            slots.data_ptr(),
            key_slots.data_ptr(),
            value_slots.data_ptr(),
            self.num_threads,
        )


def choose_rope_store_kernel(
    mode: str, device: torch.device, dtype: torch.dtype, num_threads: int
) -> RopeStoreKernel | None:
    """The kernel for EngineConfig.rope_store ("auto" | "kernel" | "torch"), or None for
    torch's ops (see kernel_build.choose_kernel)."""
    return choose_kernel(
        mode,
        "torch",
        device,
        dtype,
        lambda: load_rope_store_kernel(num_threads, dtype),
        dtypes=tuple(KV_BUILDS),
    )


@functools.cache
def load_rope_store_kernel(num_threads: int, dtype: torch.dtype = torch.float32) -> RopeStoreKernel:
    """The kernel for Q/K/V and a cache of `dtype`, compiled on first use (KernelUnavailable
    when it cannot be)."""
    return RopeStoreKernel(load_library("rope_and_store", KV_BUILDS[dtype]), num_threads)
