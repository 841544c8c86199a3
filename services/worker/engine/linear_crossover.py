"""From how many rows oneDNN computes a projection faster than the panel kernel, measured here.

The panel kernel (kernels/panel_linear.c) was faster than oneDNN at decode sizes on every CPU
it ran on, and at prefill sizes on AMD EPYC (Zen 3: 0.83-0.85x oneDNN's time for a 512-token
step); on an Intel Xeon with AMX (family 6 model 167, 2 cores) oneDNN took 0.89x the panel
kernel's time for a 512-token prefill step and 0.93x for 1,024 tokens, 0.97x at 256, and on
another Intel Xeon (model 207) 0.98x at 1,024. No rule by vendor or vector width fits every
CPU measured, so "auto" measures: when the engine is built, the projections of the model's
first layer run on both products at CANDIDATE_ROWS rows (a bfloat16 model's at
BFLOAT16_CANDIDATE_ROWS), alternated, in REPEATS rounds, the best of each,
and oneDNN takes the layers' projections from the smallest candidate at which it ran them
more than MARGIN faster and at every larger candidate (none: the panel kernel keeps them
all; where it ran the largest faster but not by that margin at each, a second set of rounds
decides on the best runs of both). A step of that many rows runs layer by layer (the
runner's choice), so one count for the whole layer: oneDNN for one projection of it would
cost the step the fused path and win back only that projection's share. Where oneDNN takes
some rows, every layer's weights get its reordered copy then, not in the first long step: a
third copy of them in memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # linear_kernel builds the Crossover: no import back at run time
    from services.worker.engine.linear_kernel import LaidOutLinear

logger = logging.getLogger(__name__)

CANDIDATE_ROWS = (256, 512, 1024)
"""Row counts measured: below the smallest the panel kernel's steps won on every CPU tried
(at 128 rows on the model 167 Xeon a step took 0.85x oneDNN's time, though oneDNN ran the
projections alone 0.90x as long)."""
BFLOAT16_CANDIDATE_ROWS = (8, 32, 128, 512)
"""Row counts measured for a bfloat16 model, whose steps all run layer by layer: from the
decode sizes, where oneDNN's AMX code may already be the faster one (the panel kernel's
bfloat16 build runs AVX-512 BF16; on an AMD EPYC Zen 4, without AMX, it took 0.68-0.87x
oneDNN's time at 8-32 rows and tied from 128; on an Intel Xeon with AMX, oneDNN took the
steps from 32 rows while the panel kernel ran FMAs, from 128 once it ran AMX tiles)."""
REPEATS = 5
"""Rounds over the candidates, each running both products at each; each product's fastest
run at a candidate counts (the least disturbed)."""
MARGIN = 0.03
"""How much faster oneDNN must run the projections alone to take a row count: its steps run
layer by layer, which costs more around the projections than the panel kernel's single C
call (decode_layers.c). Measured on the model 167 Xeon, SmolLM2-135M's first layer's
projections on oneDNN against whole prefill steps: 0.86x at 256 rows for a 0.97x step,
0.87x at 512 for 0.89x, 0.83x at 1,024 for 0.93x. On an AMD EPYC Zen 4 (2 cores), against the
prefetching panel kernel, whole steps gained about as much as the projections: 0.97x at 256
rows for a 1.00x step, 0.95x at 512 for 0.97x, 0.93x at 1,056 for 0.95x. A margin of 0.10,
then 0.05, sat on those ratios: oneDNN took 512 or 1,024 rows in some starts and none in
others (a 1,056-token prefill 1.31 s in the one, 1.46 s in the other); 0.03 gave it 256 or
512 rows in six starts of six."""

Shape = tuple[int, int]


@dataclass(slots=True)
class Crossover:
    """Per projection shape (outs, ins), the rows from which oneDNN runs it (see the module
    docstring); shapes never measured stay on the panel kernel."""

    panels: LaidOutLinear
    """The panel kernel (PanelLinear)."""
    packed: LaidOutLinear
    """oneDNN on its reordered copies (PackedLinear)."""
    candidate_rows: tuple[int, ...] = CANDIDATE_ROWS
    """The row counts measured, ascending."""
    from_rows: dict[Shape, int | None] = field(default_factory=dict)
    """The measured shapes: the fewest rows oneDNN takes, or None where it takes none."""

    def product(self, weight: torch.Tensor, rows: int) -> LaidOutLinear:
        """The product that runs `rows` rows of `weight`."""
        start = self.from_rows.get(_shape(weight))
        return self.packed if start is not None and rows >= start else self.panels

    def least_rows(self, weights: Sequence[torch.Tensor]) -> int | None:
        """The fewest rows from which any of `weights` runs on oneDNN (None: none does)."""
        starts = [self.from_rows.get(_shape(weight)) for weight in weights]
        return min((rows for rows in starts if rows is not None), default=None)

    def calibrate(self, layers: Sequence[Sequence[torch.Tensor]]) -> None:
        """Measures the first layer's weights unless their shapes were measured already (the
        same model, or one of its shapes, in this process), then gives every weight of a
        shape oneDNN takes its reordered copy."""
        if not layers:
            return
        first = layers[0]
        if any(_shape(weight) not in self.from_rows for weight in first):
            with torch.no_grad():
                start = self._measure(first)
            for weight in first:
                self.from_rows[_shape(weight)] = start
                if start is None:
                    self.packed.discard(weight)  # its copy was made to be measured only
            logger.info(
                "the layers' projections run on %s",
                "the panel kernel at every row count"
                if start is None
                else f"oneDNN from {start} rows, the panel kernel below",
            )
        for layer in layers:
            for weight in layer:
                if self.from_rows.get(_shape(weight)) is not None:
                    self.packed.laid_out(weight)

    def _measure(self, weights: Sequence[torch.Tensor]) -> int | None:
        products = (self.panels, self.packed)
        inputs = [
            [torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights]
            for rows in self.candidate_rows
        ]
        for rows_inputs in inputs:
            for product in products:
                _seconds(product, weights, rows_inputs)  # its copies made, and warm, untimed
        panel_s = [float("inf")] * len(inputs)
        packed_s = [float("inf")] * len(inputs)
        self._rounds(weights, inputs, panel_s, packed_s)
        start = first_faster_rows(self.candidate_rows, panel_s, packed_s, MARGIN)
        if start is None and packed_s[-1] < panel_s[-1]:
            # oneDNN ran the largest candidate faster, but not by the margin at every larger
            # one: a second set of rounds, each product's fastest run of both sets counting.
            # Sixteen starts on a 2-core AMD EPYC Zen 4 (2026-12-06) gave 256 or 512 rows in
            # twelve, 1,024 in two and none in two, those in noisy minutes of the host (oneDNN
            # 0.977x and 0.998x the panel kernel's time at 1,024 rows, against 0.90-0.94x in
            # the quiet starts); one that takes none keeps its prefill steps on the panel
            # kernel for its lifetime, 1.03-1.05x the time from 512 tokens there.
            self._rounds(weights, inputs, panel_s, packed_s)
            start = first_faster_rows(self.candidate_rows, panel_s, packed_s, MARGIN)
        return start

    def _rounds(
        self,
        weights: Sequence[torch.Tensor],
        inputs: Sequence[Sequence[torch.Tensor]],
        panel_s: list[float],
        packed_s: list[float],
    ) -> None:
        """REPEATS rounds, each product's fastest run at each candidate kept in panel_s and
        packed_s. Rounds over every candidate, not one candidate's runs back to back: a burst
        of other work on the host then spoils one run of several candidates, not every run of
        one. On a 2-core AMD EPYC Zen 4, where eight measurements in a row gave oneDNN 0.94x
        the panel kernel's time at 512 rows and 0.91x at 1,024, one start (bench.peers' steps
        child, three runs back to back) measured it not faster somewhere, and the panel kernel
        kept every step: 512-token prefill steps 1.05x oneDNN's time."""
        for _ in range(REPEATS):
            for index, rows_inputs in enumerate(inputs):
                panel_s[index] = min(panel_s[index], _seconds(self.panels, weights, rows_inputs))
                packed_s[index] = min(packed_s[index], _seconds(self.packed, weights, rows_inputs))


def first_faster_rows(
    rows: Sequence[int], panel_s: Sequence[float], packed_s: Sequence[float], margin: float
) -> int | None:
    """The smallest of the ascending `rows` from which `packed_s` is under (1 - margin) of
    `panel_s` at it and at every larger one (None: not at the largest)."""
    start = None
    for count, panel, packed in reversed(list(zip(rows, panel_s, packed_s, strict=True))):
        if packed >= (1 - margin) * panel:
            break
        start = count
    return start


def _seconds(
    product: LaidOutLinear, weights: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> float:
    """Time `product` takes for every weight's product with its input, one after the other."""
    started = time.perf_counter()
    for weight, x in zip(weights, inputs, strict=True):
        product(weight, x, None)
    return time.perf_counter() - started


def _shape(weight: torch.Tensor) -> Shape:
    outs, ins = weight.shape
    return outs, ins
