"""The engine in bfloat16 on the CPU, where the projections of steps of many rows run on oneDNN
or the panel kernel's bfloat16 build, those of few rows whole in the small-batch library, and
the norm or SwiGLU in one pass of that library (linear_kernel.PackedProject): each projection
against its definition, the small steps and the panel kernel's against oneDNN, the fused norm
and SwiGLU against float32 rounded once, prefill logits against transformers' float32 next to
its own bfloat16, and a continuous batch that generates without leaking a block. (The decode
kernel's bfloat16 build: test_decode_kernel.py.)"""

from __future__ import annotations

import ctypes
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine import linear_kernel
from services.worker.engine.api import FinishReason, SamplingParams
from services.worker.engine.kernel_build import load_library
from services.worker.engine.linear_kernel import (
    PackedProject,
    PanelLinear,
    bfloat16_pairs,
    bfloat16_panels,
    choose_bfloat16_project,
    onednn_available,
    onednn_bfloat16_available,
)
from services.worker.engine.loader import load_model
from services.worker.engine.model_runner import BatchEntry
from services.worker.engine.models.llama import project_with_torch, projection_input
from tests.unit.engine.greedy import transformers_model
from tests.unit.engine.test_engine import drive, make_engine, staggered
from tests.unit.engine.test_linear_kernel import FusedCall, linear, reference, rms_norm

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
CPU = torch.device("cpu")
WIDENED = ("BFLOAT16_WIDENED",)
ONEDNN_BFLOAT16 = onednn_bfloat16_available()
"""oneDNN runs bfloat16 products here (not on AVX2 alone)."""
needs_onednn_bfloat16 = pytest.mark.skipif(
    not ONEDNN_BFLOAT16, reason="oneDNN has no bfloat16 products on this CPU"
)
PANELS_BUILT = onednn_available() and bfloat16_panels(1) is not None
"""The panel kernel has a bfloat16 build here (AVX-512 BF16)."""
PROMPT_LENGTHS = (5, 17, 33, 64, 3, 40, 9, 24)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    difference = got.detach().double() - expected.detach().double()
    return float(difference.norm() / expected.detach().double().norm())


def bfloat16_case(
    ins: int, outs: int, rows: int, fused: str, weight_seed: int, seed: int
) -> tuple[nn.Linear, FusedCall]:
    """A projection and its call (test_linear_kernel's), every tensor in bfloat16."""
    module = linear(ins, outs, torch.Generator().manual_seed(weight_seed), bias="bias" in fused)
    call = FusedCall.of(ins, outs, rows, fused, seed=seed)
    call.x = call.x.to(torch.bfloat16)
    if call.norm is not None:
        call.norm = call.norm.to(torch.bfloat16)
    if call.residual is not None:
        call.residual = call.residual.to(torch.bfloat16)
    return module.to(torch.bfloat16), call


def assert_within_a_step_of_onednn(
    got: torch.Tensor, onednn: PackedProject, call: FusedCall, module: nn.Linear
) -> None:
    """Each output of `got` (float32) within one bfloat16 step of oneDNN's product of the same
    operands plus what summing in float32 in another order may move it (both sum exact
    products of the same rounded f(x) and weights, and round once; a residual is added after,
    rounded again)."""
    expected = call.run(onednn, module).float()
    inputs = onednn.projection_input(call.x.clone(), call.norm, call.gated).float()
    summed = inputs.abs() @ module.weight.float().abs().t()  # what the float32 sums carry
    ulp = expected.abs() * 2.0**-7 + summed * 2.0**-20
    if call.residual is not None:  # the product rounded before the sum: a step of its own
        ulp += (expected - call.residual.float()).abs() * 2.0**-7
    assert bool(((got - expected).abs() <= ulp).all())


@pytest.mark.parametrize(
    ("mode", "dtype", "chosen"),
    [
        ("auto", torch.bfloat16, True),
        ("onednn", torch.bfloat16, True),
        ("torch", torch.bfloat16, False),
        ("panels", torch.bfloat16, False),
        ("auto", torch.float32, False),
        ("auto", torch.float16, False),
    ],
)
def test_only_a_bfloat16_model_left_to_onednn_projects_on_it(
    mode: str, dtype: torch.dtype, chosen: bool
) -> None:
    """Where oneDNN has no bfloat16 products (AVX2 alone), "auto" leaves the model on torch's
    ops and "onednn" is refused."""
    if chosen and not ONEDNN_BFLOAT16 and mode == "onednn":
        with pytest.raises(ValueError, match="oneDNN's bfloat16 products"):
            choose_bfloat16_project(mode, "auto", CPU, dtype, 1)
        return
    project = choose_bfloat16_project(mode, "auto", CPU, dtype, 1)
    chosen = chosen and ONEDNN_BFLOAT16
    assert isinstance(project, PackedProject) if chosen else project is None
    if isinstance(project, PackedProject):
        assert project.input_function is not None  # the small-batch kernel's library
        # "auto" measures the panel kernel against oneDNN where it has a bfloat16 build.
        assert (project.crossover is not None) == (mode == "auto" and PANELS_BUILT)


def test_without_onednns_bfloat16_auto_stays_on_torch_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A CPU whose oneDNN has no bfloat16 products (AVX2 alone), on any CPU."""
    monkeypatch.setattr(linear_kernel, "onednn_bfloat16_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger=linear_kernel.__name__):
        assert choose_bfloat16_project("auto", "auto", CPU, torch.bfloat16, 1) is None
    assert "bfloat16 runs on torch's matmul here" in caplog.text
    with pytest.raises(ValueError, match="needs oneDNN's bfloat16 products"):
        choose_bfloat16_project("onednn", "auto", CPU, torch.bfloat16, 1)


@needs_onednn_bfloat16
def test_small_batch_linear_torch_keeps_the_norms_in_torch() -> None:
    project = choose_bfloat16_project("auto", "torch", CPU, torch.bfloat16, 1)
    assert project is not None and project.input_function is None


@needs_onednn_bfloat16
@pytest.mark.parametrize("rows", [1, 7, 64, 512])
@pytest.mark.parametrize("fused", ["", "norm", "gated+residual", "bias", "norm+bias+residual"])
def test_each_projection_matches_its_definition_within_bfloat16_rounding(
    rows: int, fused: str
) -> None:
    """Against the definition computed in float64 from the same bfloat16 tensors: within 1%
    (bfloat16 keeps 8 bits of each input and of the result); a weight read transposed or a
    bias or residual left out would be off by about 100%."""
    module, call = bfloat16_case(576, 960, rows, fused, weight_seed=rows, seed=rows + 1)
    project = PackedProject(load_library("small_batch_linear"), 2)
    got = call.run(project, module)
    assert got.dtype == torch.bfloat16
    assert relative_error(got, call.expected(module)) < 0.01
    # torch's own bfloat16 path agrees as closely.
    assert relative_error(got, call.run(project_with_torch, module)) < 0.01
    # oneDNN's copy of the weight made once, for the steps of more rows than stream.
    assert project.product.num_copies == (rows > project.small_max_rows)


def test_the_widened_build_widens() -> None:
    """BFLOAT16_WIDENED builds the path of CPUs without AVX-512 BF16 (the test below runs both
    builds, so both paths run on any CPU)."""
    assert not bfloat16_pairs(load_library("small_batch_linear", WIDENED))


@needs_onednn_bfloat16
@pytest.mark.parametrize("defines", [(), WIDENED])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fused", ["", "norm+bias", "gated+residual"])
@pytest.mark.parametrize(("ins", "outs"), [(576, 960), (64, 7), (40, 3), (100, 9)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_small_steps_stream_what_onednn_computes(
    rows: int, ins: int, outs: int, fused: str, threads: int, defines: tuple[str, ...]
) -> None:
    """Steps of up to small_max_rows rows run whole in the small-batch library
    (bfloat16_small_batch_linear), oneDNN not called (by default only the few rows where it is
    faster, but it computes any number): against oneDNN's product of the same
    bfloat16 operands, each output within one bfloat16 step plus what summing in float32 in
    another order may move it (both sum exact products of the same rounded f(x) and weights,
    and round once; the residual is added after). In bfloat16 pairs (AVX-512 BF16) and
    widened (weight rows streamed up to 3 rows, then four at a time, with tails of fewer than
    four and a thread with no group of four); rows of whole and part pair vectors."""
    module, call = bfloat16_case(ins, outs, rows, fused, weight_seed=outs, seed=rows * 100 + outs)
    library = load_library("small_batch_linear", defines)
    streamed = PackedProject(library, threads, small_max_rows=8)  # more than by default
    onednn = PackedProject(library, threads, small_max_rows=0)
    got = call.run(streamed, module).float()
    assert streamed.product.num_copies == 0
    assert_within_a_step_of_onednn(got, onednn, call, module)
    assert onednn.product.num_copies == 1


@pytest.mark.skipif(not PANELS_BUILT, reason="the kernels are not built for AVX-512 BF16 here")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fused", ["", "norm+bias", "gated+residual"])
@pytest.mark.parametrize(("ins", "outs"), [(576, 960), (41, 7), (64, 33), (1536, 576)])
@pytest.mark.parametrize("rows", [4, 5, 8, 13, 32, 70])
@pytest.mark.parametrize(
    "build", [(), ("BFLOAT16_FMA",), ("AMX_TILES",)], ids=["vdpbf16ps", "fma", "amx"]
)
def test_larger_steps_on_the_panel_kernel_compute_what_onednn_computes(
    build: tuple[str, ...], rows: int, ins: int, outs: int, fused: str, threads: int
) -> None:
    """Steps of more rows than stream, on the panel kernel's bfloat16 build (vdpbf16ps,
    float32 FMAs on widened operands, or AMX tiles), oneDNN not called: each output within one
    bfloat16 step of oneDNN's product of the same operands plus what summing in float32 in
    another order may move it, the residual added after the rounded product. Row tiles whole
    and cut (AMX: 16-row tiles in pairs, a lone last one), output panels whole and cut, an odd
    input count (its last input paired with a zero; AMX: inputs padded to whole tiles)."""
    panel_build = load_library("panel_linear", build)
    panel_build.panel_linear_bfloat16_tiles.restype = ctypes.c_int
    if "AMX_TILES" in build and panel_build.panel_linear_bfloat16_tiles() != 1:
        pytest.skip("no AMX here")
    module, call = bfloat16_case(ins, outs, rows, fused, weight_seed=ins, seed=rows * 100 + outs)
    library = load_library("small_batch_linear")
    built = PanelLinear(panel_build, threads, True, torch.bfloat16)
    panels = PackedProject(library, threads, small_max_rows=0, panels=built)
    onednn = PackedProject(library, threads, small_max_rows=0)
    got = call.run(panels, module).float()
    assert panels.product.num_copies == 0
    assert panels.crossover is not None and panels.crossover.panels.num_copies == 1
    assert_within_a_step_of_onednn(got, onednn, call, module)


@pytest.mark.skipif(not PANELS_BUILT, reason="the kernels are not built for AVX-512 BF16 here")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("ins", "outs"), [(576, 960), (41, 7), (1536, 576)])
@pytest.mark.parametrize("rows", [5, 8, 32, 70, 2500])
def test_the_streaming_bfloat16_panels_compute_the_same_bits(
    rows: int, ins: int, outs: int, threads: int
) -> None:
    """The panel kernel's bfloat16 build asking for its next panel while it runs one (and its
    rows in blocks: 2,500 rows of 576 or 1,536 inputs are more than one block) gives the same
    bits as without: what it asks for ahead changes no sum, nor where a block starts."""
    module, call = bfloat16_case(ins, outs, rows, "norm+bias", weight_seed=ins, seed=rows + outs)
    library = load_library("small_batch_linear")
    results = []
    for prefetch in (False, True):
        panels = bfloat16_panels(threads, prefetch)
        assert panels is not None and panels.prefetch is prefetch
        project = PackedProject(library, threads, small_max_rows=0, panels=panels)
        results.append(call.run(project, module))
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fused", ["norm", "gated"])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_the_norm_and_swiglu_in_one_pass_round_as_torch_does(
    rows: int, fused: str, threads: int
) -> None:
    """The library's bfloat16 norm and SwiGLU against the same in float32 rounded once: at
    most one bfloat16 step apart (their sums run in another order, and exp_approx is within an
    ulp of expf); torch's own ops land as close. Strided rows (a view of a wider tensor) too."""
    generator = torch.Generator().manual_seed(rows)
    ins = 576
    wide = torch.randn(rows, 2 * ins + 8, generator=generator).bfloat16()
    x = wide[:, : 2 * ins] if fused == "gated" else wide[:, :ins]
    norm = rms_norm(ins, generator).to(torch.bfloat16) if fused == "norm" else None
    project = PackedProject(load_library("small_batch_linear"), threads)
    got = project.projection_input(x, norm, fused == "gated")
    wide32 = x.float()
    if norm is not None:
        expected = F.rms_norm(wide32, (ins,), norm.weight.float(), norm.eps)
    else:
        gate, up = wide32.chunk(2, dim=-1)
        expected = F.silu(gate) * up
    steps = (got.float() - expected.bfloat16().float()).abs()
    ulp = expected.abs().clamp(min=1e-30) * 2.0**-7
    assert got.dtype == torch.bfloat16 and got.shape == (rows, ins)
    assert bool((steps <= ulp).all())
    assert bool(
        (projection_input(x, norm, fused == "gated").float() - got.float()).abs().le(2 * ulp).all()
    )


def test_other_modules_and_shapes_go_to_torch() -> None:
    module = linear(16, 8, torch.Generator().manual_seed(2)).to(torch.bfloat16)
    project = PackedProject()
    x = torch.randn(2, 3, 16).to(torch.bfloat16)  # not a 2-D step
    with torch.inference_mode():
        got = project(module, x)
    assert got.shape == (2, 3, 8)
    torch.testing.assert_close(
        got.float(), reference(module, x.reshape(6, 16)).view(2, 3, 8), atol=0.1, rtol=0.02
    )
    assert project.product.num_copies == 0


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir: Path) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    vocab = load_model(str(tiny_llama_dir)).config.vocab_size
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def test_prefill_logits_stay_as_close_to_float32_as_transformers_bfloat16(
    tiny_llama_dir: Path, prompts: list[list[int]]
) -> None:
    """The last position's logits of each prompt against transformers' in float32: on average
    within 1.5x of how far transformers' own bfloat16 model lands (2-6% of the largest logit
    here: bfloat16 keeps 8 bits of mantissa, and each sums in its own order). On torch's ops
    where oneDNN has no bfloat16 products."""
    runner = make_engine(load_model(str(tiny_llama_dir), dtype=torch.bfloat16)).runner
    assert isinstance(runner.project, PackedProject) == ONEDNN_BFLOAT16
    reference = transformers_model(tiny_llama_dir, "cpu", torch.float32)
    theirs = transformers_model(tiny_llama_dir, "cpu", torch.bfloat16)
    ours_off, theirs_off = [], []
    for prompt in prompts:
        table = list(range(math.ceil(len(prompt) / runner.block_size)))
        ours = runner.forward([BatchEntry(prompt, 0, table)])[0].float()
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0, -1]
            bfloat16 = theirs(torch.tensor([prompt])).logits[0, -1].float()
        scale = expected.abs().max()
        ours_off.append(float((ours - expected).abs().max() / scale))
        theirs_off.append(float((bfloat16 - expected).abs().max() / scale))
    assert sum(ours_off) <= 1.5 * sum(theirs_off), (ours_off, theirs_off)


def test_a_continuous_batch_generates_without_leaking(
    tiny_llama_dir: Path, prompts: list[list[int]]
) -> None:
    engine = make_engine(load_model(str(tiny_llama_dir), dtype=torch.bfloat16))
    results = drive(engine, staggered(prompts, SamplingParams(max_tokens=16, ignore_eos=True)))
    assert [len(results[f"r{i}"].token_ids) for i in range(len(prompts))] == [16] * len(prompts)
    assert all(r.finish_reason is FinishReason.LENGTH for r in results.values())
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
