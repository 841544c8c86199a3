"""Where oneDNN takes a projection's larger steps from the panel kernel: the rule on given
timings, the routing by shape and rows, the measurement's bookkeeping, and a runner whose
larger steps run layer by layer on both products matching the panel kernel alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from services.worker.engine import linear_crossover
from services.worker.engine.decode_kernel import choose_decode_kernel
from services.worker.engine.decode_layers_kernel import layer_projections
from services.worker.engine.kernel_build import load_library
from services.worker.engine.linear_crossover import (
    BFLOAT16_CANDIDATE_ROWS,
    REPEATS,
    Crossover,
    first_faster_rows,
)
from services.worker.engine.linear_kernel import (
    PackedLinear,
    PackedProject,
    PanelLinear,
    SmallBatchLinear,
    bfloat16_panels,
    kernel_weights,
    onednn_available,
)
from services.worker.engine.loader import LoadedModel, load_model
from services.worker.engine.model_runner import BatchEntry, ModelRunner
from services.worker.engine.prefill_kernel import choose_prefill_kernel
from services.worker.engine.rope_store_kernel import choose_rope_store_kernel

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch without oneDNN")

ROWS = (128, 256, 512, 1024)


def test_onednn_takes_the_rows_from_which_it_is_faster_at_every_larger_count() -> None:
    panel = [1.0, 2.0, 4.0, 8.0]
    assert first_faster_rows(ROWS, panel, [1.1, 2.1, 3.8, 7.0], 0.03) == 512
    assert first_faster_rows(ROWS, panel, [0.9, 2.1, 3.8, 7.0], 0.03) == 512  # not 128: 256 lost
    assert first_faster_rows(ROWS, panel, [0.9, 1.9, 3.8, 7.0], 0.03) == 128
    assert first_faster_rows(ROWS, panel, [0.9, 1.9, 3.8, 8.5], 0.03) is None  # lost at 1,024
    assert first_faster_rows(ROWS, panel, [1.0, 2.0, 3.9, 7.9], 0.03) is None  # within margin


def test_the_measurement_runs_rounds_over_every_candidate_and_keeps_each_fastest_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each round times both products at every candidate, so a burst of other work spoils one
    run of several candidates, not every run of one; each product's fastest run counts."""
    chooser = Crossover(PanelLinear(load_library("panel_linear"), 2), PackedLinear(), (2, 4, 8))
    timed: list[tuple[str, int]] = []

    def seconds(product: object, weights: object, inputs: list[torch.Tensor]) -> float:
        rows = inputs[0].shape[0]
        name = "panels" if product is chooser.panels else "onednn"
        timed.append((name, rows))
        if len(timed) <= 6:  # the untimed warm-up of each product at each candidate
            return 0.0
        spoiled = len(timed) in (8, 10)  # the first round's oneDNN runs at 2 and 4 rows
        return rows * (1.0 if name == "panels" else 0.9) * (5.0 if spoiled else 1.0)

    monkeypatch.setattr(linear_crossover, "_seconds", seconds)
    assert chooser._measure([torch.zeros(3, 5)]) == 2
    one_round = [(name, rows) for rows in (2, 4, 8) for name in ("panels", "onednn")]
    assert timed == one_round * (1 + REPEATS)


@pytest.mark.parametrize(
    ("first_onednn", "second_onednn", "rounds", "expected"),
    [
        # oneDNN faster at the largest count but within the margin there: a second look.
        ((1.0, 1.0, 0.98), (0.9, 0.9, 0.9), 2 * REPEATS, 2),
        # The second look's best runs decide even where it is as unclear as the first.
        ((1.0, 1.0, 0.98), (1.0, 1.0, 0.99), 2 * REPEATS, None),
        # oneDNN slower at the largest count: the panel kernel keeps every step at once.
        ((0.9, 0.9, 1.1), (0.5, 0.5, 0.5), REPEATS, None),
        # A clear first answer stands.
        ((1.0, 0.9, 0.9), (0.5, 0.5, 0.5), REPEATS, 4),
    ],
)
def test_an_unclear_measurement_where_onednn_won_the_largest_count_is_taken_again(
    monkeypatch: pytest.MonkeyPatch,
    first_onednn: tuple[float, ...],
    second_onednn: tuple[float, ...],
    rounds: int,
    expected: int | None,
) -> None:
    """oneDNN's time per row against the panel kernel's 1.0 at 2, 4 and 8 rows, in the first
    set of rounds and in a second: a noisy minute at start-up must not leave every prefill
    step on the panel kernel for the worker's lifetime where oneDNN ran the largest faster."""
    chooser = Crossover(PanelLinear(load_library("panel_linear"), 2), PackedLinear(), (2, 4, 8))
    onednn_runs = 0

    def seconds(product: object, weights: object, inputs: list[torch.Tensor]) -> float:
        nonlocal onednn_runs
        rows = inputs[0].shape[0]
        if product is chooser.panels:
            return float(rows)
        onednn_runs += 1
        if onednn_runs <= 3:  # the untimed warm-up at each candidate
            return 0.0
        per_row = first_onednn if onednn_runs <= 3 + 3 * REPEATS else second_onednn
        return rows * per_row[(2, 4, 8).index(rows)]

    monkeypatch.setattr(linear_crossover, "_seconds", seconds)
    assert chooser._measure([torch.zeros(3, 5)]) == expected
    assert onednn_runs == 3 + 3 * rounds


def crossover() -> Crossover:
    return Crossover(PanelLinear(load_library("panel_linear"), 2), PackedLinear())


def test_each_shape_runs_on_the_product_its_measured_rows_name() -> None:
    chooser = crossover()
    generator = torch.Generator().manual_seed(3)
    wide = torch.randn(48, 32, generator=generator)
    narrow = torch.randn(16, 32, generator=generator)
    unmeasured = torch.randn(40, 32, generator=generator)
    chooser.from_rows = {(48, 32): 8, (16, 32): None}
    assert chooser.product(wide, 7) is chooser.panels
    assert chooser.product(wide, 8) is chooser.packed
    assert chooser.product(narrow, 4096) is chooser.panels  # oneDNN took no count of it
    assert chooser.product(unmeasured, 4096) is chooser.panels
    assert chooser.least_rows([wide, narrow]) == 8 and chooser.least_rows([narrow]) is None


def test_a_projection_past_the_crossover_matches_the_panel_kernels() -> None:
    chooser = crossover()
    project = SmallBatchLinear(
        load_library("small_batch_linear"), 2, large=chooser.panels, crossover=chooser
    )
    generator = torch.Generator().manual_seed(4)
    module = nn.Linear(32, 48, bias=False)
    with torch.no_grad():
        module.weight.copy_(torch.randn(48, 32, generator=generator))
    chooser.from_rows = {(48, 32): 8}
    for rows in (4, 8, 20):
        x = torch.randn(rows, 32, generator=generator)
        with torch.inference_mode():
            expected = chooser.panels(module.weight, x, None)
            torch.testing.assert_close(project(module, x), expected, atol=1e-5, rtol=1e-5)
    assert chooser.packed.num_copies == 1  # made at the first product of 8 rows


def test_calibration_measures_the_first_layer_once_and_lays_out_what_onednn_takes(
    tiny_llama_dir: Path,
) -> None:
    model = load_model(str(tiny_llama_dir)).model
    layers = [
        [kernel_weights(m)[0] for m in layer_projections(layer)]  # type: ignore[index]
        for layer in model.decoder_layers()
    ]
    chooser = crossover()
    chooser.calibrate(layers)
    shapes = {tuple(w.shape) for w in layers[0]}
    assert set(chooser.from_rows) == shapes
    taken = [w for layer in layers for w in layer if chooser.from_rows[tuple(w.shape)] is not None]
    assert chooser.packed.num_copies == len(taken)  # every layer's, and only those
    measured = dict(chooser.from_rows)
    chooser.calibrate(layers)
    assert chooser.from_rows == measured  # measured once


@pytest.mark.skipif(bfloat16_panels(2) is None, reason="no AVX-512 BF16 build of the kernels")
def test_a_bfloat16_runner_measures_its_panel_kernel_against_onednn_at_decode_sizes(
    tiny_llama_dir: Path,
) -> None:
    """A bfloat16 model's PackedProject with the panel kernel is calibrated by its runner on
    the first layer's shapes, at BFLOAT16_CANDIDATE_ROWS (from decode sizes on: its steps all
    run layer by layer, and oneDNN may be faster there on a CPU with AMX)."""
    loaded = load_model(str(tiny_llama_dir), dtype=torch.bfloat16)
    project = PackedProject(load_library("small_batch_linear"), 2, panels=bfloat16_panels(2))
    ModelRunner(loaded, 64, project=project)
    assert project.crossover is not None
    assert project.crossover.candidate_rows == BFLOAT16_CANDIDATE_ROWS
    first = loaded.model.decoder_layers()[0]
    shapes = {
        tuple(kernel_weights(m)[0].shape)  # type: ignore[index]
        for m in layer_projections(first)
    }
    assert set(project.crossover.from_rows) == shapes


class CountedPacked(PackedLinear):
    """oneDNN's product, counting the rows it computes."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def __call__(
        self,
        weight: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.rows += x.shape[0]
        return super().__call__(weight, x, residual, bias)


def runner(loaded: LoadedModel, from_rows: int | None) -> tuple[ModelRunner, CountedPacked]:
    """A runner on every kernel whose projections run on oneDNN from `from_rows` rows
    (None: the panel kernel at every count), set before its measurement would run."""
    packed = CountedPacked()
    chooser = Crossover(PanelLinear(load_library("panel_linear"), 2), packed)
    shapes = {
        tuple(kernel_weights(m)[0].shape)  # type: ignore[index]
        for m in layer_projections(loaded.model.decoder_layers()[0])
    }
    chooser.from_rows = dict.fromkeys(shapes, from_rows)
    linear = SmallBatchLinear(
        load_library("small_batch_linear"), 2, large=chooser.panels, crossover=chooser
    )
    cpu, f32 = torch.device("cpu"), torch.float32
    built = ModelRunner(
        loaded,
        64,
        decode_kernel=choose_decode_kernel("auto", cpu, f32, 2),
        prefill_kernel=choose_prefill_kernel("auto", cpu, f32, 2),
        rope_store_kernel=choose_rope_store_kernel("auto", cpu, f32, 2),
        linear_kernel=linear,
    )
    return built, packed


def test_steps_past_the_crossover_run_layer_by_layer_and_agree_with_the_panel_kernel(
    tiny_llama_dir: Path,
) -> None:
    loaded = load_model(str(tiny_llama_dir))
    (split, on_onednn), (panels, _) = runner(loaded, 12), runner(loaded, None)
    assert split.onednn_from_rows == 12 and panels.onednn_from_rows is None
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, loaded.config.vocab_size, (20,), generator=generator).tolist()
    batch = [BatchEntry(prompt, 0, [0, 1])]  # 20 rows: past the crossover, one chunk
    decode = [BatchEntry(prompt[:1], 20, [0, 1])]  # 1 row: the small-batch kernel
    torch.testing.assert_close(split.forward(batch), panels.forward(batch), atol=1e-4, rtol=1e-4)
    layers = len(loaded.model.decoder_layers())
    # Every projection of every layer but the last, where only Q/K/V take all 20 rows (its
    # other projections compute the one row whose logits are wanted); then no more:
    on_onednn_rows = 20 * 4 * (layers - 1) + 20
    assert on_onednn.rows == on_onednn_rows
    torch.testing.assert_close(split.forward(decode), panels.forward(decode), atol=1e-4, rtol=1e-4)
    assert on_onednn.rows == on_onednn_rows
