"""Building, caching and choosing the engine's C kernels (kernel_build.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.worker.engine import kernel_build
from services.worker.engine.decode_kernel import choose_decode_kernel, load_decode_kernel
from services.worker.engine.kernel_build import KernelUnavailable, cpu_vendor, load_library
from services.worker.engine.linear_kernel import (
    PANELS_BY_DEFAULT_LANES,
    PREFETCH_BY_DEFAULT,
    PackedLinear,
    PanelLinear,
    choose_linear_kernel,
    kernel_lanes,
    large_product,
    load_linear_kernel,
    onednn_available,
)
from services.worker.engine.prefill_kernel import choose_prefill_kernel, load_prefill_kernel
from services.worker.engine.rope_store_kernel import (
    choose_rope_store_kernel,
    load_rope_store_kernel,
)

CPU = torch.device("cpu")
KERNELS = (
    "decode_layers",
    "paged_decode_attention",
    "paged_prefill_attention",
    "panel_linear",
    "rope_and_store",
    "small_batch_linear",
)


def test_every_kernel_source_is_built() -> None:
    assert sorted(p.stem for p in kernel_build.KERNELS_DIR.glob("*.c")) == sorted(KERNELS)


@pytest.mark.parametrize(
    ("choose", "load", "fallback", "dtypes"),
    [
        (
            choose_decode_kernel,
            lambda threads, dtype=torch.float32: load_decode_kernel(threads, dtype),
            "sdpa",
            "float32 and bfloat16",
        ),
        (
            choose_prefill_kernel,
            lambda threads, dtype=torch.float32: load_prefill_kernel(threads, dtype),
            "sdpa",
            "float32 and bfloat16",
        ),
        (
            choose_rope_store_kernel,
            lambda threads, dtype=torch.float32: load_rope_store_kernel(threads, dtype),
            "torch",
            "float32 and bfloat16",
        ),
        (
            choose_linear_kernel,
            lambda threads: load_linear_kernel(threads, "auto"),
            "torch",
            "float32",
        ),
    ],
)
def test_choice_follows_the_mode_and_the_tensors(
    choose: Callable[..., object], load: Callable[..., object], fallback: str, dtypes: str
) -> None:
    assert choose(fallback, CPU, torch.float32, 1) is None
    assert choose("auto", CPU, torch.float32, 1) is load(1)
    # The kernels that read or write the KV cache have a bfloat16 model's build of their own.
    bfloat16 = choose("auto", CPU, torch.bfloat16, 1)
    assert bfloat16 is (load(1, torch.bfloat16) if "bfloat16" in dtypes else None)
    assert choose("auto", torch.device("cuda"), torch.float32, 1) is None
    with pytest.raises(ValueError, match=f"CPU {dtypes} only"):
        choose("kernel", CPU, torch.float16, 1)


def test_without_a_compiler_auto_falls_back_and_kernel_refuses(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-kvmesh")
    loaders = (load_decode_kernel, load_prefill_kernel, load_rope_store_kernel, load_linear_kernel)
    for loader in loaders:
        loader.cache_clear()
    try:
        for choose, fallback in (
            (choose_decode_kernel, "sdpa"),
            (choose_prefill_kernel, "sdpa"),
            (choose_rope_store_kernel, "torch"),
            (choose_linear_kernel, "torch"),
        ):
            with pytest.raises(KernelUnavailable, match="no C compiler"):
                choose("kernel", CPU, torch.float32, 1)
            assert choose("auto", CPU, torch.float32, 1) is None
            assert f"falls back to {fallback}" in caplog.text
    finally:
        for loader in loaders:
            loader.cache_clear()


def test_a_source_that_does_not_compile_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(kernel_build, "KERNELS_DIR", tmp_path / "src")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "broken.c").write_text("int broken( {\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(KernelUnavailable, match=r"broken\.c"):
        kernel_build.build("broken")


@pytest.mark.parametrize("name", KERNELS)
def test_build_is_cached_by_source_and_compiled_once(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = kernel_build.build(name)
    assert first.parent == tmp_path / "kvmesh" / "kernels"
    assert first.name.startswith(f"{name}-")
    built_at = os.stat(first).st_mtime_ns
    assert kernel_build.build(name) == first
    assert os.stat(first).st_mtime_ns == built_at  # reused, not rebuilt
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no scratch left behind


def test_a_changed_header_builds_the_kernel_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "shared.h").write_text("static inline int one(void) { return 1; }\n")
    (source / "uses.c").write_text('#include "shared.h"\nint uses(void) { return one(); }\n')
    monkeypatch.setattr(kernel_build, "KERNELS_DIR", source)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = kernel_build.build("uses")
    (source / "shared.h").write_text("static inline int one(void) { return 2; }\n")
    second = kernel_build.build("uses")
    assert second != first
    assert kernel_build.load_library("uses").uses() == 2


@pytest.mark.parametrize("large", ["auto", "panels", "panels-prefetch", "onednn", "torch"])
def test_large_steps_take_the_product_they_are_told(large: str) -> None:
    chosen = choose_linear_kernel("auto", CPU, torch.float32, 1, large)
    assert chosen is load_linear_kernel(1, large)
    assert chosen is not None
    products = {
        "panels": PanelLinear,
        "panels-prefetch": PanelLinear,
        "onednn": PackedLinear,
        "torch": type(None),
    }
    if large == "auto":  # by the kernels' vector width, as built for this CPU, and its maker
        lanes = kernel_lanes(load_library("small_batch_linear"))
        default = "onednn" if onednn_available() else "torch"
        prefetch = (cpu_vendor(), lanes) in PREFETCH_BY_DEFAULT
        panels = "panels-prefetch" if prefetch else "panels"
        large = panels if lanes in PANELS_BY_DEFAULT_LANES else default
    assert type(chosen.large) is products[large]
    if isinstance(chosen.large, PanelLinear):
        prefetching = large == "panels-prefetch"
        name = "panel_linear_prefetching" if prefetching else "panel_linear"
        assert chosen.large.function.__name__ == name


@pytest.mark.parametrize(
    ("vendor", "lanes", "function"),
    [
        ("GenuineIntel", 16, "panel_linear_prefetching"),
        ("GenuineIntel", 8, "panel_linear_prefetching"),
        ("AuthenticAMD", 16, "panel_linear_prefetching"),
        ("AuthenticAMD", 8, "panel_linear_prefetching"),
        ("", 16, "panel_linear"),
    ],
)
def test_auto_prefetches_panels_on_the_cpus_where_that_was_measured_faster(
    monkeypatch: pytest.MonkeyPatch, vendor: str, lanes: int, function: str
) -> None:
    cpuinfo = ["processor\t: 0", f"vendor_id\t: {vendor}", "flags\t: fpu"] if vendor else []
    monkeypatch.setattr(kernel_build, "_cpuinfo_lines", lambda: cpuinfo)
    kernel_build.cpu_vendor.cache_clear()
    try:
        assert kernel_build.cpu_vendor() == vendor
        product = large_product("auto", lanes, 1)
        assert isinstance(product, PanelLinear)
        assert product.function.__name__ == function
    finally:
        kernel_build.cpu_vendor.cache_clear()


@pytest.mark.parametrize(
    "kernel", ["small_batch_linear", "paged_decode_attention", "paged_prefill_attention"]
)
def test_every_loop_calling_exp_approx_is_vectorized(kernel: str, tmp_path: Path) -> None:
    """With the kernels' flags GCC vectorizes each loop that calls exp_approx (the SwiGLU, the
    softmaxes): with -ftrapping-math (GCC's default) its clamps were control flow and these
    loops ran one float at a time."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None or "Free Software Foundation" not in kernel_build._run(
        [compiler, "--version"]
    ):
        pytest.skip("the vectorizer's report read here is GCC's")
    source = kernel_build.KERNELS_DIR / f"{kernel}.c"
    target = tmp_path / "kernel.so"
    report = subprocess.run(
        [
            compiler,
            *kernel_build.CFLAGS,
            "-fopt-info-vec-optimized",
            str(source),
            "-o",
            str(target),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    vectorized = {
        int(line.split(":")[1]) for line in report.splitlines() if "loop vectorized" in line
    }
    lines = source.read_text().splitlines()
    loops = []
    for number, line in enumerate(lines, start=1):
        # A call in a loop: its `for` is on the call's line or one of the two before it.
        heads = [n for n in range(number - 2, number + 1) if "for (" in lines[n - 1]]
        if "exp_approx(" in line and heads:
            loops.append((number, heads[-1]))
    assert loops
    for call, head in loops:
        # GCC names a loop by its `for` line or by its body's.
        assert {call, head} & vectorized, f"{kernel}.c:{call} is not vectorized"
