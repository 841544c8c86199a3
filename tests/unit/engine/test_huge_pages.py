"""Memory on huge pages (huge_pages.py): aligned, zeroed, and faulted in up front when asked."""

from __future__ import annotations

import resource

import pytest
import torch

from services.worker.engine.huge_pages import HUGE_PAGE_BYTES, huge_page_bytes

SIZE = 64 << 20


def faults_writing(memory: torch.Tensor) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    memory.fill_(7)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.parametrize("populate", [False, True])
def test_memory_is_zeroed_and_starts_on_a_huge_page(populate: bool) -> None:
    memory = huge_page_bytes(SIZE, populate=populate)
    assert memory.numel() == SIZE and memory.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not memory.any()


def test_populated_memory_takes_no_page_fault_when_first_written() -> None:
    """Left to first writes, every page (huge or not) faults when a step first writes it; the
    KV cache and the placed weights are populated when made instead."""
    assert faults_writing(huge_page_bytes(SIZE)) > 0
    assert faults_writing(huge_page_bytes(SIZE, populate=True)) == 0
