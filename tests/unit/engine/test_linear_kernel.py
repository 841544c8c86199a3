"""The small-batch linear kernel against the same projections computed by torch."""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine import linear_kernel
from services.worker.engine.config import EngineConfig
from services.worker.engine.kernel_build import load_library
from services.worker.engine.linear_kernel import (
    MAX_ROWS_BY_LANES,
    PANEL_MIN_ROWS,
    TRANSPOSED_MAX_ROWS,
    LaidOutLinear,
    PackedLinear,
    PanelLinear,
    SmallBatchLinear,
    load_linear_kernel,
    place_weights,
)
from services.worker.engine.models.llama import Project, RMSNorm, project_with_torch
from services.worker.engine.quant import Int8Linear

CPU = torch.device("cpu")
# Multiples of the kernel's 8-float vectors and 4-row weight groups, and every kind of tail.
SHAPES = [(576, 960), (64, 128), (13, 7), (29, 6), (8, 3)]
# The kernel's row counts: the streamed path (1-3), the four-row path, and the largest step it
# takes by default on any CPU (MAX_ROWS_BY_LANES).
KERNEL_ROWS = [1, 2, 3, 5, *sorted(set(MAX_ROWS_BY_LANES.values()))]


def kernel(threads: int) -> SmallBatchLinear:
    """The kernel computing every step of KERNEL_ROWS itself, whatever this CPU's default."""
    return SmallBatchLinear(load_library("small_batch_linear"), threads, max_rows=max(KERNEL_ROWS))


def linear(ins: int, outs: int, generator: torch.Generator, bias: bool = False) -> nn.Linear:
    module = nn.Linear(ins, outs, bias=bias)
    module.weight = nn.Parameter(torch.randn(outs, ins, generator=generator))
    if bias:  # far from zero, so that a bias left out or misplaced shows
        module.bias = nn.Parameter(torch.randn(outs, generator=generator) * 4)
    return module


def rms_norm(size: int, generator: torch.Generator) -> RMSNorm:
    norm = RMSNorm(size, eps=1e-5)
    norm.weight = nn.Parameter(torch.rand(size, generator=generator) + 0.5)
    return norm


def reference(
    module: nn.Module,
    x: torch.Tensor,
    norm: RMSNorm | None = None,
    gated: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The projection's definition, in float64."""
    x = x.double()
    if norm is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    if isinstance(module, Int8Linear):
        weight = module.weight_int8.double() * module.scales.double()[:, None]
    else:
        assert isinstance(module, nn.Linear)
        weight = module.weight.detach().double()
    y = x @ weight.T
    if module.bias is not None:
        y = y + module.bias.double()
    return (y if residual is None else y + residual.double()).float()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", KERNEL_ROWS)
@pytest.mark.parametrize(("ins", "outs"), SHAPES)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_kernel_matches_matmul(threads: int, rows: int, ins: int, outs: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + ins + outs)
    module = linear(ins, outs, generator, bias)
    x = torch.randn(rows, ins, generator=generator)
    with torch.inference_mode():
        got = kernel(threads)(module, x)
    assert got.shape == (rows, outs)
    torch.testing.assert_close(got, reference(module, x), atol=1e-4, rtol=1e-4)


@dataclass(slots=True)
class FusedCall:
    """A projection's input and the work fused around it ("norm", "gated", "residual")."""

    x: torch.Tensor
    norm: RMSNorm | None
    gated: bool
    residual: torch.Tensor | None

    @classmethod
    def of(cls, ins: int, outs: int, rows: int, fused: str, seed: int) -> FusedCall:
        generator = torch.Generator().manual_seed(seed)
        gated = "gated" in fused
        return cls(
            x=torch.randn(rows, 2 * ins if gated else ins, generator=generator),
            norm=rms_norm(ins, generator) if "norm" in fused else None,
            gated=gated,
            residual=torch.randn(rows, outs, generator=generator) if "residual" in fused else None,
        )

    def expected(self, module: nn.Module) -> torch.Tensor:
        return reference(module, self.x, self.norm, self.gated, self.residual)

    def run(self, project: Project, module: nn.Module) -> torch.Tensor:
        """The projection, on copies of the tensors it may write."""
        with torch.inference_mode():
            return project(
                module,
                self.x.clone(),
                norm=self.norm,
                gated=self.gated,
                residual=None if self.residual is None else self.residual.clone(),
            )


@pytest.mark.parametrize("rows", [1, 4, 7])
@pytest.mark.parametrize(("ins", "outs"), SHAPES)
@pytest.mark.parametrize(
    "fused", ["norm", "gated", "residual", "norm+residual", "gated+bias+residual"]
)
def test_fused_work_matches_torch(rows: int, ins: int, outs: int, fused: str) -> None:
    module = linear(ins, outs, torch.Generator().manual_seed(ins + outs), bias="bias" in fused)
    call = FusedCall.of(ins, outs, rows, fused, seed=rows * 1000 + ins * 10 + outs)
    expected = call.expected(module)
    torch.testing.assert_close(call.run(project_with_torch, module), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        call.run(load_linear_kernel(2), module), expected, atol=1e-4, rtol=1e-4
    )
    if call.residual is not None:
        for project in (project_with_torch, load_linear_kernel(2)):
            residual = call.residual.clone()
            with torch.inference_mode():
                got = project(
                    module, call.x.clone(), residual=residual, norm=call.norm, gated=call.gated
                )
            # In place: the layers read the residual afterwards, not the returned tensor.
            assert got is residual
            torch.testing.assert_close(residual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", KERNEL_ROWS)
@pytest.mark.parametrize(("ins", "outs"), SHAPES)
@pytest.mark.parametrize("fused", ["", "norm", "gated+residual", "bias", "norm+bias"])
def test_int8_weights_are_scaled_per_output(rows: int, ins: int, outs: int, fused: str) -> None:
    generator = torch.Generator().manual_seed(ins * 7 + outs)
    module = Int8Linear(linear(ins, outs, generator, bias="bias" in fused))
    call = FusedCall.of(ins, outs, rows, fused, seed=rows * 100 + ins * 7 + outs)
    # float32 activations against the dequantized weight (torch's int8 matmul rounds them to
    # bf16, so it is only within ~1e-2 of this).
    torch.testing.assert_close(
        call.run(kernel(2), module), call.expected(module), atol=1e-4, rtol=1e-4
    )


def test_kernel_takes_strided_rows() -> None:
    generator = torch.Generator().manual_seed(3)
    module = linear(64, 12, generator)
    wide = torch.randn(4, 100, generator=generator)
    rows = wide[:, 10:74]  # row stride 100, unit column stride: read in place
    columns = torch.randn(64, 4, generator=generator).T  # column stride 4: copied first
    with torch.inference_mode():
        for x in (rows, columns):
            torch.testing.assert_close(
                load_linear_kernel(2)(module, x), reference(module, x), atol=1e-4, rtol=1e-4
            )


def test_each_projection_takes_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(4)
    paths: list[str] = []

    def recorded(name: str, run: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def record(*args: Any, **kwargs: Any) -> torch.Tensor:
            paths.append(name)
            return run(*args, **kwargs)

        return record

    for name in ("project_with_torch", "transposed_product"):
        monkeypatch.setattr(linear_kernel, name, recorded(name, getattr(linear_kernel, name)))
    project = SmallBatchLinear(load_library("small_batch_linear"), num_threads=1, max_rows=4)
    module = linear(16, 8, generator)
    quantized = Int8Linear(module)
    with_bias = linear(16, 8, generator, bias=True)
    quantized_with_bias = Int8Linear(with_bias)
    transposed = nn.Linear(16, 8, bias=False)
    transposed.weight = nn.Parameter(torch.randn(16, 8, generator=generator).T)
    few, some = torch.randn(4, 16, generator=generator), torch.randn(5, 16, generator=generator)
    many = torch.randn(TRANSPOSED_MAX_ROWS + 1, 16, generator=generator)
    cases: dict[str, list[tuple[nn.Module, torch.Tensor]]] = {
        # A bias (Qwen2's Q/K/V) takes the bias-free projection's path: no fallback for it.
        "kernel": [(module, few), (quantized, few), (with_bias, few), (quantized_with_bias, few)],
        "transposed_product": [
            (module, some),
            (module, torch.randn(TRANSPOSED_MAX_ROWS, 16)),
            (with_bias, some),
        ],
        "project_with_torch": [
            (module, many),
            (with_bias, many),
            (quantized, some),
            (quantized_with_bias, some),
            (transposed, few),
        ],
    }
    with torch.inference_mode():
        for path, calls in cases.items():
            for other, x in calls:
                paths.clear()
                # torch's own int8 matmul rounds activations to bf16: compared with itself.
                expected = other(x) if path == "project_with_torch" else reference(other, x)
                torch.testing.assert_close(project(other, x), expected, atol=1e-4, rtol=1e-4)
                assert paths == ([] if path == "kernel" else [path]), (other, x.shape)


@pytest.mark.parametrize("rows", [max(MAX_ROWS_BY_LANES.values()) + 1, 64, TRANSPOSED_MAX_ROWS])
@pytest.mark.parametrize("fused", ["", "norm", "gated+residual", "bias", "norm+bias+residual"])
def test_transposed_product_matches(rows: int, fused: str) -> None:
    module = linear(64, 96, torch.Generator().manual_seed(rows), bias="bias" in fused)
    call = FusedCall.of(64, 96, rows, fused, seed=rows)
    torch.testing.assert_close(
        call.run(load_linear_kernel(2), module), call.expected(module), atol=1e-4, rtol=1e-4
    )
    if call.residual is not None:  # the matmul adds into the residual itself
        residual = call.residual.clone()
        with torch.inference_mode():
            load_linear_kernel(2)(
                module, call.x.clone(), norm=call.norm, gated=call.gated, residual=residual
            )
        torch.testing.assert_close(residual, call.expected(module), atol=1e-4, rtol=1e-4)


def large_products() -> dict[str, Callable[[], LaidOutLinear]]:
    """The products of larger steps (large_batch_linear), each made afresh."""
    return {
        "onednn": PackedLinear,
        "panels": lambda: PanelLinear(load_library("panel_linear"), 2),
        "panels-prefetch": lambda: PanelLinear(load_library("panel_linear"), 2, prefetch=True),
    }


# 100 outputs: three whole panels and a part of one on AVX-512, six and a part on AVX2.
@pytest.mark.parametrize("large", ["onednn", "panels", "panels-prefetch"])
@pytest.mark.parametrize("fused", ["", "norm", "gated+residual", "bias", "norm+bias+residual"])
def test_larger_steps_run_on_weights_laid_out_once(fused: str, large: str) -> None:
    packed = large_products()[large]()
    project = SmallBatchLinear(load_library("small_batch_linear"), 1, max_rows=4, large=packed)
    module = linear(64, 100, torch.Generator().manual_seed(3), bias="bias" in fused)
    # Every remainder of the panel kernel's row tiles (6 or 8 rows), and prefill chunks.
    for rows in (*range(5, 18), TRANSPOSED_MAX_ROWS, 512):
        call = FusedCall.of(64, 100, rows, fused, seed=rows)
        torch.testing.assert_close(
            call.run(project, module), call.expected(module), atol=1e-4, rtol=1e-4
        )
        if call.residual is not None:
            # Added into in place, whether its rows are contiguous or not.
            for residual in (call.residual.clone(), call.residual.t().contiguous().t()):
                with torch.inference_mode():
                    got = project(
                        module, call.x.clone(), norm=call.norm, gated=call.gated, residual=residual
                    )
                assert got is residual
                torch.testing.assert_close(residual, call.expected(module), atol=1e-4, rtol=1e-4)
    assert packed.num_copies == 1  # laid out on first use, then reused
    del module, call
    assert packed.num_copies == 0  # the copy went with its weight


@pytest.mark.parametrize("threads", [1, 2])
def test_prefetching_its_next_panel_changes_no_bit_of_the_panel_kernels_product(
    threads: int,
) -> None:
    """Every tile count (its share of the next panel's lines, down to none), a last panel in
    part, both thread counts (each thread's last panel asks for the next thread's first), and
    rows that outgrow any L2 (6 MB and more of x: the prefetching kernel runs them in blocks,
    the last one partly filled)."""
    library = load_library("panel_linear")
    plain, prefetching = PanelLinear(library, threads), PanelLinear(library, threads, True)
    assert prefetching.function.__name__ == "panel_linear_prefetching"
    generator = torch.Generator().manual_seed(11)
    shapes = [(96, rows) for rows in (*range(1, 18), 64, 129, 512)] + [(1536, 1000), (1536, 2003)]
    modules = {ins: linear(ins, 100, generator, bias=True) for ins in (96, 1536)}
    for ins, rows in shapes:
        module = modules[ins]
        x = torch.randn(rows, ins, generator=generator)
        with torch.inference_mode():
            expected = plain(module.weight, x, None, module.bias)
            assert torch.equal(prefetching(module.weight, x, None, module.bias), expected)


BUILDS = {"plain": (), "even tiles": ("EVEN_TILES",)}
"""The panel kernel's builds: AMD's, and Intel's (linear_kernel.panel_library)."""


def panel_row_tiles(rows: int, defines: tuple[str, ...]) -> list[int]:
    """The row tiles the panel kernel's build runs `rows` rows of a panel in."""
    library = load_library("panel_linear", defines)
    library.panel_linear_tile_rows.restype = ctypes.c_int64
    library.panel_linear_tile_rows.argtypes = [ctypes.c_int64]
    tiles: list[int] = []
    while sum(tiles) < rows:
        tiles.append(library.panel_linear_tile_rows(rows - sum(tiles)))
    return tiles


@pytest.mark.parametrize("build", BUILDS)
def test_row_tiles_are_even_on_avx2_where_every_tile_keeps_5_rows_or_more(build: str) -> None:
    """On AVX2 (6-row tiles, either build) 32 rows run as 6+6+5+5+5+5, not 6+6+6+6+6+2, but 13
    rows as 6+6+1, since 5+4+4 was slower; AVX-512's 14-row tiles stay whole, a remainder
    last, but for a last tile of one row: 15 rows run as 8+7; and in the build for Intel
    CPUs they are even where every tile keeps 10 rows or more: 32 rows as 11+11+10."""
    defines = BUILDS[build]
    library = load_library("panel_linear", defines)
    library.panel_linear_width.restype = ctypes.c_int
    if library.panel_linear_width() == 16:  # AVX2: 6-row tiles
        expected = {1: [1], 6: [6], 7: [6, 1], 10: [5, 5], 13: [6, 6, 1], 20: [5, 5, 5, 5]}
        expected[32] = [6, 6, 5, 5, 5, 5]
    elif not defines:  # AVX-512: 14-row tiles
        expected = {1: [1], 13: [13], 14: [14], 15: [8, 7], 16: [14, 2], 20: [14, 6]}
        expected |= {28: [14, 14], 29: [14, 8, 7], 32: [14, 14, 4]}
    else:  # AVX-512, even from 10 rows
        expected = {1: [1], 13: [13], 14: [14], 15: [8, 7], 16: [14, 2], 20: [10, 10]}
        expected |= {28: [14, 14], 29: [14, 8, 7], 32: [11, 11, 10], 64: [13, 13, 13, 13, 12]}
    assert {rows: panel_row_tiles(rows, defines) for rows in expected} == expected


@pytest.mark.parametrize(
    ("vendor", "flags", "defines"),
    [
        ("GenuineIntel", {"avx512_bf16"}, ("EVEN_TILES", "BFLOAT16_FMA")),
        ("GenuineIntel", {"avx512_bf16", "amx_bf16"}, ("EVEN_TILES", "AMX_TILES")),
        ("AuthenticAMD", {"avx512_bf16"}, ()),
        ("AuthenticAMD", {"amx_bf16"}, ("AMX_TILES",)),
    ],
)
def test_the_panel_kernel_is_built_for_the_cpus_vendor_and_amx(
    monkeypatch: pytest.MonkeyPatch, vendor: str, flags: set[str], defines: tuple[str, ...]
) -> None:
    """By vendor (EVEN_TILES_VENDORS, BFLOAT16_FMA_VENDORS), and where the CPU has AMX-BF16
    its bfloat16 products on AMX tiles, in place of the FMA build."""
    monkeypatch.setattr(linear_kernel, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(linear_kernel, "cpu_has_amx", lambda: "amx_bf16" in flags)
    built: list[tuple[str, tuple[str, ...]]] = []

    def load(name: str, given: tuple[str, ...] = ()) -> None:
        built.append((name, given))

    monkeypatch.setattr(linear_kernel, "load_library", load)
    linear_kernel.panel_library()
    assert built == [("panel_linear", defines)]


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("prefetch", [False, True])
def test_a_rows_product_is_the_same_bit_for_bit_whatever_tile_it_falls_in(
    prefetch: bool, build: str
) -> None:
    panels = PanelLinear(load_library("panel_linear", BUILDS[build]), 2, prefetch)
    generator = torch.Generator().manual_seed(5)
    module = linear(96, 100, generator, bias=True)
    x = torch.randn(41, 96, generator=generator)
    with torch.inference_mode():
        alone = torch.cat([panels(module.weight, row[None], None, module.bias) for row in x])
        for rows in range(2, 42):
            assert torch.equal(panels(module.weight, x[:rows], None, module.bias), alone[:rows])


def counted_panels(rows: list[int]) -> PanelLinear:
    """The panel kernel, noting in `rows` the rows of every product it computes."""
    panels = PanelLinear(load_library("panel_linear"), 2)
    kernel = panels.function

    def counted(x: int, count: int, *rest: Any) -> None:
        rows.append(count)
        kernel(x, count, *rest)

    panels.function = counted  # type: ignore[assignment]
    return panels


def test_where_panels_run_larger_steps_float32_ones_of_two_rows_run_there_too() -> None:
    """PANEL_MIN_ROWS: float32 projections of 2 rows or more on the panel kernel, of one row
    on the small-batch kernel; int8 ones (the panel kernel reads float32 only) on the small-
    batch kernel up to its max_rows. With oneDNN as the larger product nothing changes."""
    generator = torch.Generator().manual_seed(8)
    module = linear(64, 100, generator)
    quantized = Int8Linear(linear(64, 100, generator))
    on_panels: list[int] = []
    project = SmallBatchLinear(
        load_library("small_batch_linear"), 2, max_rows=16, large=counted_panels(on_panels)
    )
    assert project.float_max_rows == PANEL_MIN_ROWS - 1 == 1
    for rows in (1, 2, 5, 16, 17):
        call = FusedCall.of(64, 100, rows, "norm", seed=rows)
        torch.testing.assert_close(
            call.run(project, module), call.expected(module), atol=1e-4, rtol=1e-4
        )
        call.run(project, quantized)
    assert on_panels == [2, 5, 16, 17]
    onednn = SmallBatchLinear(
        load_library("small_batch_linear"), 2, max_rows=16, large=PackedLinear()
    )
    assert onednn.float_max_rows == 16


def test_streamed_weights_are_placed_in_one_buffer_in_reading_order() -> None:
    generator = torch.Generator().manual_seed(6)
    first, second = linear(16, 8, generator), linear(13, 7, generator)
    tied = linear(8, 16, generator)
    quantized = Int8Linear(linear(16, 8, generator, bias=True))
    transposed = nn.Linear(16, 8, bias=False)  # not the kernel's: left where it is
    transposed.weight = nn.Parameter(torch.randn(16, 8, generator=generator).T)
    embedding = nn.Embedding(16, 8, _weight=tied.weight.detach())
    embedding.weight = tied.weight
    model = nn.Sequential(embedding, first, transposed, second, quantized, tied)
    streamed = [first.weight, second.weight, quantized.weight_int8, tied.weight]
    before = [tensor.clone() for tensor in streamed]
    left = transposed.weight.data_ptr()
    place_weights(model)
    addresses = [tensor.data_ptr() for tensor in streamed]
    for tensor, value in zip(streamed, before, strict=True):
        assert torch.equal(tensor, value)
    assert all(address % 64 == 0 for address in addresses)
    # One after another, each padded to a cache line (7 x 13 floats: 364 -> 384 bytes).
    assert [b - a for a, b in itertools.pairwise(addresses)] == [512, 384, 128]
    assert embedding.weight.data_ptr() == addresses[-1] and transposed.weight.data_ptr() == left
    x = torch.randn(2, 16, generator=generator)
    with torch.inference_mode():
        torch.testing.assert_close(
            load_linear_kernel(1)(first, x), reference(first, x), atol=1e-4, rtol=1e-4
        )
    place_weights(model)  # once per model
    assert [tensor.data_ptr() for tensor in streamed] == addresses


def test_bad_shapes_are_refused() -> None:
    generator = torch.Generator().manual_seed(5)
    module = linear(16, 8, generator)
    project = load_linear_kernel(1)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="rows of 32 values"):
            project(module, torch.randn(2, 16), gated=True)
        with pytest.raises(ValueError, match="does not fit"):
            project(module, torch.randn(2, 16), residual=torch.zeros(2, 9))
        with pytest.raises(ValueError, match="not both"):
            project(module, torch.randn(2, 32), norm=rms_norm(32, generator), gated=True)


def test_config_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="small_batch_linear must be one of"):
        EngineConfig(small_batch_linear="blas").validate()
