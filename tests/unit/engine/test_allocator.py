"""The C allocator keeps what a step frees (allocator.py), and the engine asks it to."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from services.worker.engine import engine as engine_module
from services.worker.engine.loader import load_model
from tests.unit.engine.test_engine import make_engine

# A step's activations (20 tensors of 10 MiB, all alive at its peak), allocated and freed on the
# main thread as LLM's offline engine does; prints the page faults one such step takes.
STEPS = """
import resource, sys, torch
import ctypes
from services.worker.engine.allocator import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
else:
    # glibc's thresholds as a process starts (128 KiB): how far its dynamic threshold has
    # risen by now depends on what the imports happened to free.
    mallopt = ctypes.CDLL(None).mallopt
    assert mallopt(M_MMAP_THRESHOLD, 128 << 10) and mallopt(M_TRIM_THRESHOLD, 128 << 10)

def step():
    # Alive together, then freed together: a step's peak working set.
    held = [torch.empty(1024, 2560).fill_(1.0) for _ in range(20)]
    del held

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

for _ in range(3):
    step()
before = faults()
for _ in range(10):
    step()
print((faults() - before) / 10)
"""


def faults_per_step(mode: str) -> float:
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", STEPS, mode], capture_output=True, text=True, cwd=root, check=True
    )
    return float(done.stdout.split()[-1])


def test_freed_step_memory_is_reused_without_page_faults() -> None:
    """glibc's starting thresholds give a step's large freed blocks back to the system, so
    every step faults their pages in again; kept, a step after the first faults none."""
    if not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("the C library has no mallopt (not glibc)")
    default = faults_per_step("default")
    assert default > 10_000  # pages of 4 KiB: most of the 200 MiB a step frees
    assert faults_per_step("keep") == 0


@pytest.mark.parametrize("keep", [True, False])
def test_engine_asks_the_allocator_to_keep_freed_memory_on_the_cpu(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, keep: bool
) -> None:
    asked: list[bool] = []

    def record() -> bool:
        asked.append(True)
        return True

    monkeypatch.setattr(engine_module, "keep_freed_memory", record)
    make_engine(load_model(str(tiny_llama_dir)), keep_freed_memory=keep)
    assert asked == ([True] if keep else [])
