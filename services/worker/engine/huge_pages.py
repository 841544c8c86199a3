"""Memory asked for on transparent huge pages, for what the kernels stream: the weights of
the small-batch projections (linear_kernel.place_weights) and the paged KV cache
(model_runner). On 4 KiB pages the hardware prefetcher stops at every page boundary and each
page costs a TLB miss. Where the kernel gives no huge pages (transparent_hugepage "never")
the memory is plain and nothing else changes."""

from __future__ import annotations

import mmap

import torch

# Transparent huge pages' size on x86 and most ARM kernels.
HUGE_PAGE_BYTES = 2 << 20


def huge_page_bytes(size: int) -> torch.Tensor:
    """`size` zeroed bytes (a uint8 tensor) starting on a huge page boundary. The tensors made
    from it keep its memory alive."""
    # Private: shared anonymous memory is shmem, whose huge pages are a separate setting
    # (shmem_enabled, "never" by default).
    buffer = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(buffer, dtype=torch.uint8)
    start = -memory.data_ptr() % HUGE_PAGE_BYTES
    return memory[start : start + size]
