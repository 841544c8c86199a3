"""The small-batch linear kernel against the same projections computed by torch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine import linear_kernel
from services.worker.engine.config import EngineConfig
from services.worker.engine.kernel_build import load_library
from services.worker.engine.linear_kernel import (
    MAX_ROWS,
    SmallBatchLinear,
    choose_linear_kernel,
    load_linear_kernel,
)
from services.worker.engine.models.llama import RMSNorm, project_with_torch
from services.worker.engine.quant import Int8Linear

CPU = torch.device("cpu")
# Multiples of the kernel's 8-float vectors and 4-row weight groups, and every kind of tail.
SHAPES = [(576, 960), (64, 128), (13, 7), (29, 6), (8, 3)]


def linear(ins: int, outs: int, generator: torch.Generator) -> nn.Linear:
    module = nn.Linear(ins, outs, bias=False)
    module.weight = nn.Parameter(torch.randn(outs, ins, generator=generator))
    return module


def rms_norm(size: int, generator: torch.Generator) -> RMSNorm:
    norm = RMSNorm(size, eps=1e-5)
    norm.weight = nn.Parameter(RMSNorm.weight_from_hf(torch.rand(size, generator=generator) + 0.5))
    return norm


def reference(
    module: nn.Linear | Int8Linear,
    x: torch.Tensor,
    norm: RMSNorm | None = None,
    gated: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The projection's definition, in float64."""
    x = x.double()
    if norm is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.hf_weight().double()
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    if isinstance(module, Int8Linear):
        weight = module.weight_int8.double() * module.scales.double()[:, None]
    else:
        weight = module.weight.detach().double()
    y = x @ weight.T
    return (y if residual is None else y + residual.double()).float()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, MAX_ROWS])
@pytest.mark.parametrize(("ins", "outs"), SHAPES)
def test_kernel_matches_matmul(threads: int, rows: int, ins: int, outs: int) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + ins + outs)
    module = linear(ins, outs, generator)
    x = torch.randn(rows, ins, generator=generator)
    with torch.inference_mode():
        got = load_linear_kernel(threads)(module, x)
    assert got.shape == (rows, outs)
    torch.testing.assert_close(got, reference(module, x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 4, 7])
@pytest.mark.parametrize(("ins", "outs"), SHAPES)
@pytest.mark.parametrize("fused", ["norm", "gated", "residual", "norm+residual"])
def test_fused_work_matches_torch(rows: int, ins: int, outs: int, fused: str) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + ins * 10 + outs)
    module = linear(ins, outs, generator)
    norm = rms_norm(ins, generator) if "norm" in fused else None
    gated = fused == "gated"
    x = torch.randn(rows, 2 * ins if gated else ins, generator=generator)
    residual = torch.randn(rows, outs, generator=generator) if "residual" in fused else None
    expected = reference(module, x, norm, gated, residual)
    with torch.inference_mode():
        by_torch = project_with_torch(
            module,
            x.clone(),
            norm=norm,
            gated=gated,
            residual=None if residual is None else residual.clone(),
        )
        got = load_linear_kernel(2)(module, x, norm=norm, gated=gated, residual=residual)
    torch.testing.assert_close(by_torch, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    if residual is not None:
        assert got is residual  # added in place, as torch's path does


@pytest.mark.parametrize("rows", [1, 2, 3, 5, MAX_ROWS])
@pytest.mark.parametrize(("ins", "outs"), SHAPES)
@pytest.mark.parametrize("fused", ["", "norm", "gated+residual"])
def test_int8_weights_are_scaled_per_output(rows: int, ins: int, outs: int, fused: str) -> None:
    generator = torch.Generator().manual_seed(rows * 100 + ins * 7 + outs)
    module = Int8Linear(linear(ins, outs, generator))
    norm = rms_norm(ins, generator) if "norm" in fused else None
    gated = "gated" in fused
    x = torch.randn(rows, 2 * ins if gated else ins, generator=generator)
    residual = torch.randn(rows, outs, generator=generator) if "residual" in fused else None
    expected = reference(module, x, norm, gated, residual)
    with torch.inference_mode():
        got = load_linear_kernel(2)(module, x, norm=norm, gated=gated, residual=residual)
    # float32 activations against the dequantized weight (torch's int8 matmul rounds them to
    # bf16, so it is only within ~1e-2 of this).
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


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


def test_projection_takes_the_kernel_only_where_it_applies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    generator = torch.Generator().manual_seed(4)
    by_torch: list[nn.Module] = []

    def counted(module: nn.Module, x: torch.Tensor, **fused: Any) -> torch.Tensor:
        by_torch.append(module)
        return project_with_torch(module, x, **fused)

    monkeypatch.setattr(linear_kernel, "project_with_torch", counted)
    project = SmallBatchLinear(load_library("small_batch_linear"), num_threads=1, max_rows=4)
    module = linear(16, 8, generator)
    few = torch.randn(4, 16, generator=generator)
    with torch.inference_mode():
        torch.testing.assert_close(project(module, few), module(few), atol=1e-5, rtol=1e-5)
        quantized = Int8Linear(module)
        torch.testing.assert_close(project(quantized, few), reference(quantized, few))
        assert by_torch == []
        many = torch.randn(5, 16, generator=generator)  # past max_rows: torch's matmul
        with_bias = nn.Linear(16, 8)
        transposed = nn.Linear(16, 8, bias=False)
        transposed.weight = nn.Parameter(torch.randn(16, 8, generator=generator).T)
        others = [(module, many), (with_bias, few), (transposed, few)]
        for other, x in others:
            torch.testing.assert_close(project(other, x), other(x))
    assert by_torch == [other for other, _ in others]


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


def test_choice_follows_the_mode_and_the_tensors() -> None:
    assert choose_linear_kernel("torch", CPU, torch.float32, 1) is None
    assert choose_linear_kernel("auto", CPU, torch.float32, 1) is load_linear_kernel(1)
    assert choose_linear_kernel("auto", CPU, torch.bfloat16, 1) is None
    assert choose_linear_kernel("auto", torch.device("cuda"), torch.float32, 1) is None
    with pytest.raises(ValueError, match="CPU float32 only"):
        choose_linear_kernel("kernel", CPU, torch.float16, 1)


def test_config_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="small_batch_linear must be one of"):
        EngineConfig(small_batch_linear="blas").validate()
