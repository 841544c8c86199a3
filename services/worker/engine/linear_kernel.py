"""Small-batch linear layers (kernels/small_batch_linear.c): loaded, called, chosen per step.

A decode step with one to a few rows is the weights' matrix-vector products: each weight is
read once and used for that many multiply-adds, so the step can run as fast as memory
streams the weights. torch's fp32 matmul does not get there on the CPU for these shapes (on
2 cores of an AMD EPYC, 6-13 GB/s against a 24 GB/s copy); the kernel reads each weight row
once over all threads at about the copy bandwidth. Larger batches keep torch's matmul, which
reuses each weight across enough rows to be bound by arithmetic instead. Where torch has
oneDNN, they run as oneDNN's matmul on weights reordered once into its blocked layout
(PackedLinear), which skips the packing that torch's matmul does on every call and, on an
AVX-512 CPU, runs oneDNN's AVX-512 code where torch's MKL product keeps to AVX2 on AMD (AMD
EPYC Zen 5, 2 cores, side by side: 512-token prefill steps 0.45x the time, 32-row decode
steps 0.78x, 64-row 0.52x). Where the kernels are built for AVX-512 or AVX2 they run on the
panel kernel instead (PanelLinear, kernels/panel_linear.c), faster again there, except the row
counts from which oneDNN measures faster on the machine (linear_crossover.py). Without either,
steps of up to TRANSPOSED_MAX_ROWS rows use torch's transposed product, larger ones its plain
product.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from services.worker.engine.huge_pages import huge_page_bytes
from services.worker.engine.kernel_build import (
    KernelUnavailable,
    choose_kernel,
    cpu_has_amx,
    cpu_vendor,
    load_library,
)
from services.worker.engine.linear_crossover import BFLOAT16_CANDIDATE_ROWS, Crossover
from services.worker.engine.models.llama import RMSNorm, project_with_torch, projection_input
from services.worker.engine.quant import Int8Linear

logger = logging.getLogger(__name__)

# Models whose streamed weights already live in a huge-page buffer (place_weights).
_PLACED: weakref.WeakSet[nn.Module] = weakref.WeakSet()

# Up to how many rows the kernel beats oneDNN on reordered weights, by the floats in the
# kernel's vectors (small_batch_linear_lanes), measured side by side on SmolLM2-135M's
# projections (every layer and lm_head), 2 cores: with AVX2's 8 (AMD EPYC Zen 2) up to 48
# rows (48: 121 vs 143 ms, 64: 175 vs 170), with AVX-512's 16 up to 16 (AMD EPYC Zen 4; on
# Zen 5 oneDNN is as fast from 12 rows), where oneDNN runs AVX-512 code too.
MAX_ROWS_BY_LANES = {8: 48, 16: 16}
# Where the larger steps run on the panel kernel, float32 steps of this many rows or more run
# there too: it took the small-batch kernel's place from 2 rows (measured after the limits
# above, which were set against oneDNN). Decode steps of SmolLM2-135M (200-token contexts, AMD
# EPYC Zen 4, 2 cores, alternated in one process): 0.66x the time at 2 rows, 0.47x at 6, 0.59x
# at 8, 0.79x at 16; 1.10x at 1 row, which stays on the small-batch kernel.
PANEL_MIN_ROWS = 2
# The kernels' vector widths (kernel_lanes) on which "auto" runs the steps of more rows on the
# panel kernel instead of oneDNN: AVX-512's 16, measured faster there (kernels/panel_linear.c),
# and AVX2's 8: whole steps of SmolLM2-135M on an AMD EPYC Zen 3 (2 cores), against oneDNN
# with the small-batch kernel up to 48 rows, min of 5 alternated, two runs: a 512-token
# prefill 0.83-0.85x the time, 128 tokens 0.76-0.82x, 64 tokens beside 16 decode rows 0.72x,
# decode steps of 2-4 rows 0.85-0.95x, of 8-16 rows 0.98-1.04x, of 32-64 rows 0.77-0.93x.
PANELS_BY_DEFAULT_LANES = frozenset({8, 16})
# The CPUs, by vendor, whose panel kernel runs a step's rows in even row tiles
# (kernels/panel_linear.c's EVEN_TILES build): on an Intel Xeon (family 6 model 167) a 32-row
# decode step 0.97-0.98x the time of 14 + 14 + 4 rows; on a model 207 guest, both builds in
# one process alternated, min of 30, 72.5 vs 76.4 ms (medians a tie), a 128-token prefill 140
# vs 151, 8-64 rows within 2.5%; on an AMD EPYC Zen 4 even tiles were slower.
EVEN_TILES_VENDORS = frozenset({"GenuineIntel"})
# The CPUs, by vendor, whose panel kernel runs a bfloat16 model's products on float32 FMAs over
# widened operands (kernels/panel_linear.c's BFLOAT16_FMA build) instead of vdpbf16ps: on an
# Intel Xeon (family 6 model 207, AVX-512 BF16 without AMX) a 512-token prefill 0.66-0.67x the
# time, a 32-row decode 0.77-0.84x (the same bits there; panel_linear.c). On an
# AMD EPYC Zen 4 the vdpbf16ps build ran bfloat16 steps at about twice float32's speed
# (BENCHMARKS.md, "Peers ... in bfloat16").
BFLOAT16_FMA_VENDORS = frozenset({"GenuineIntel"})
# The panel kernel's build defines, each with the CPU vendors it is built for; where the CPU has
# AMX-BF16, its AMX_TILES build runs a bfloat16 model's products on AMX tiles instead of the
# FMA build (panel_library; kernels/panel_linear.c).
PANEL_BUILDS = {"EVEN_TILES": EVEN_TILES_VENDORS, "BFLOAT16_FMA": BFLOAT16_FMA_VENDORS}
# The CPUs, by vendor (/proc/cpuinfo's vendor_id) and the kernels' vector width (kernel_lanes),
# on which "auto" runs the panel kernel prefetching its next panel, its rows in blocks that
# stay in L2 (kernels/panel_linear.c). Intel, where SmolLM2-135M's decode-size projections took
# 0.64-0.74x the time and 1,024-row ones 0.92x (family 6 model 207, AVX-512; 512 rows a tie).
# AMD with AVX-512: whole steps on a Zen 4 (2 cores), alternated in one process, min of 9, three
# runs: 32-row decode 0.94-0.95x the time, 64 rows 0.95-1.00x, a 128-token prefill 0.95-0.96x,
# 200 tokens 0.97-0.98x, 8 rows a tie, 2 rows 1.04-1.06x (a lone request's 1-row steps stay on
# the small-batch kernel). AMD with AVX2: whole steps on a Zen 3 (2 cores), alternated in one
# process, min of 9, two runs: decode steps of 8 rows 0.73-0.76x the time, 16 rows 0.78x, 32
# rows 0.86-0.88x, 64 rows 0.95-0.96x, 2 rows and prefill steps of 128-200 tokens a tie; the
# AVX2 build streams steps of up to 128 rows only, since larger ones took 1.02-1.04x the time
# streamed (panel_linear.c).
PREFETCH_BY_DEFAULT = frozenset(
    {("GenuineIntel", 8), ("GenuineIntel", 16), ("AuthenticAMD", 8), ("AuthenticAMD", 16)}
)
# From there up to this many rows, torch's matmul (MKL) is faster asked for the transposed
# product W x^T than for x W^T (measured on the target CPU, side by side: decode steps of 32
# rows 16% shorter, of 64 rows 10%; at 512 rows the plain product is faster again).
TRANSPOSED_MAX_ROWS = 128
# A bfloat16 model's steps of up to this many rows run their projections on the small-batch
# kernel (bfloat16_small_batch_linear) instead of oneDNN, by whether the kernel meets the
# weights as bfloat16 pairs (AVX-512 BF16: bfloat16_small_batch_pairs) or widens each one
# first. SmolLM2-135M's projections of one step on 2 cores of an AMD EPYC Zen 4 (AVX-512 BF16,
# no AMX), weights on huge pages, min of 7 alternated, kernel against oneDNN: in pairs 1 row
# 9.8 vs 17.0 ms, 2 rows 10.6 vs 19.2, 3 rows 10.6 vs 15.9, 4 rows 12.4 vs 15.6, 6 rows 15.9 vs
# 15.1, 8 rows 19.9 vs 18.4; widened 1 row 11.6 vs 18.1, 2 rows 18.8 vs 19.3, 3 rows 21.5 vs
# 17.2 (three instructions a weight vector bound it by arithmetic from 2 rows).
BFLOAT16_SMALL_MAX_ROWS = {True: 4, False: 1}
# The same where the larger steps run on the panel kernel's bfloat16 build (AVX-512 BF16, so
# in pairs): whole decode steps (300-token contexts, AMD EPYC Zen 4, 2 cores, min of 9
# alternated), small-batch kernel against the panel kernel: 2 rows 11.7 vs 13.3 ms, 3 rows
# 12.5 vs 14.1, 4 rows 17.9 vs 15.0.
BFLOAT16_SMALL_MAX_ROWS_BESIDE_PANELS = 3

_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64
# The library's projection-input functions (float32 rows, or bfloat16 ones).
_INPUT_ARGTYPES: list[Any] = [
    *(_POINTER, _INT, _INT),  # x, rows, x row stride
    *(_POINTER, ctypes.c_float, ctypes.c_int),  # norm weight (or NULL), eps, gated
    *(_INT, _POINTER, ctypes.c_int),  # width of f(x), out, threads
]


@dataclass(slots=True, frozen=True)
class LayerProjections:
    """How decode_layers.c runs a model's layer projections inside its one call per step."""

    small: Any
    """The library's small-batch product (small_batch_linear, or bfloat16_small_batch_linear)
    for steps of up to small_rows rows."""
    small_rows: int
    """The most rows of a step the small-batch product runs."""
    input: Any
    """f(x) in front of the panel kernel (projection_input, or bfloat16_projection_input)."""
    panels: PanelLinear | None
    """The panel kernel for the steps of more rows (None: those never run in one call)."""
    threads: int
    """OpenMP threads of each kernel call."""


class SmallBatchLinear:
    """The CPU's Project (models/llama.py): projections of at most max_rows rows (Int8Linear,
    or nn.Linear in float32: at most float_max_rows of those) run through the kernel, their
    norm, SwiGLU, bias (Qwen2's Q/K/V) and residual add fused in; larger float32 ones on the
    large product when given (the panel kernel or oneDNN), else those of up to
    TRANSPOSED_MAX_ROWS rows as torch's transposed product, a bias added by the same matmul
    either way; anything else (bigger batches without oneDNN, larger int8 ones, other
    modules) as torch's plain product."""

    def __init__(
        self,
        library: ctypes.CDLL,
        num_threads: int,
        max_rows: int | None = None,
        large: LaidOutLinear | None = None,
        crossover: Crossover | None = None,
    ) -> None:
        """max_rows: the most rows it computes (by default MAX_ROWS_BY_LANES for the
        kernel's vector width); large: runs the float32 projections of more rows when given
        (instead of torch's products): oneDNN's (PackedLinear) or the panel kernel's;
        crossover: where given (with large the panel kernel), oneDNN runs the projections
        of as many rows as it measured faster from (linear_crossover.py)."""
        self.large = large
        self.crossover = crossover
        self.function = library.small_batch_linear
        self.function.restype = ctypes.c_int
        # weight, int8 scales (or NULL), bias (or NULL)
        self.function.argtypes = small_batch_argtypes(_POINTER, _POINTER, _POINTER)
        self.input_function = library.projection_input
        self.input_function.restype = ctypes.c_int
        self.input_function.argtypes = _INPUT_ARGTYPES
        self.num_threads = num_threads
        if max_rows is None:
            max_rows = MAX_ROWS_BY_LANES[kernel_lanes(library)]
        self.max_rows = max_rows

    @property
    def float_max_rows(self) -> int:
        """The most rows of a float32 projection it computes itself: max_rows, or fewer where
        the panel kernel runs the larger ones (PANEL_MIN_ROWS)."""
        if isinstance(self.large, PanelLinear):
            return min(self.max_rows, PANEL_MIN_ROWS - 1)
        return self.max_rows

    def layer_projections(self, int8: bool) -> LayerProjections:
        """The projections as decode_layers.c runs them, as this Project runs them. int8: the
        model has int8 projections, which the panel kernel does not take: then the steps of
        more rows than the kernel's run layer by layer."""
        panels = self.large if isinstance(self.large, PanelLinear) and not int8 else None
        small_rows = self.float_max_rows if panels is not None else self.max_rows
        return LayerProjections(
            self.function, small_rows, self.input_function, panels, self.num_threads
        )

    def __call__(
        self,
        module: nn.Module,
        x: torch.Tensor,
        *,
        norm: RMSNorm | None = None,
        gated: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        weights = kernel_weights(module)
        if weights is None or x.dim() != 2:
            return project_with_torch(module, x, norm=norm, gated=gated, residual=residual)
        weight, scales, bias = weights
        limit = self.max_rows if scales is not None else self.float_max_rows
        if x.shape[0] > limit or (residual is not None and not residual.is_contiguous()):
            if scales is None:
                if self.large is not None:
                    x = self.projection_input(x, norm, gated)
                    large = (
                        self.large
                        if self.crossover is None
                        else self.crossover.product(weight, x.shape[0])
                    )
                    return large(weight, x, residual, bias)
                if x.shape[0] <= TRANSPOSED_MAX_ROWS:
                    x = projection_input(x, norm, gated)
                    return transposed_product(weight, x, residual, bias)
            return project_with_torch(module, x, norm=norm, gated=gated, residual=residual)
        pointers = (
            weight.data_ptr(),
            None if scales is None else scales.data_ptr(),
            None if bias is None else bias.data_ptr(),
        )
        return run_small_batch(
            self.function, module, weight, pointers, x, norm, gated, residual, self.num_threads
        )

    def projection_input(self, x: torch.Tensor, norm: RMSNorm | None, gated: bool) -> torch.Tensor:
        """f(x) of a Project in one pass of the kernel's library (torch's RMSNorm is six
        element-wise passes on the CPU, its SwiGLU two); x is float32 on the CPU."""
        if norm is None and not gated:
            return x
        return library_projection_input(self.input_function, x, norm, gated, self.num_threads)


def small_batch_argtypes(*weights: Any) -> list[Any]:
    """The argtypes of the library's small-batch products, `weights` the types of their
    weight arguments (the weight, then the float32 kernel's int8 scales, and the bias)."""
    return [
        *(_POINTER, _INT, _INT),  # x, rows, x row stride
        *(_POINTER, ctypes.c_float, ctypes.c_int),  # norm weight (or NULL), eps, gated
        *weights,
        *(_INT, _INT),  # in, outs
        *(_POINTER, ctypes.c_int, ctypes.c_int),  # y, accumulate, threads
    ]


def run_small_batch(
    function: Callable[..., int],
    module: nn.Module,
    weight: torch.Tensor,
    pointers: tuple[int | None, ...],
    x: torch.Tensor,
    norm: RMSNorm | None,
    gated: bool,
    residual: torch.Tensor | None,
    num_threads: int,
) -> torch.Tensor:
    """y = f(x) W^T (+ residual, in place) by one of the library's small-batch products:
    `pointers` its weight arguments (small_batch_argtypes)."""
    x, y = kernel_operands(module, weight, x, norm, gated, residual)
    outs, ins = weight.shape
    # No torch.profiler.record_function around the call: at ~8 us it would cost a third
    # of a batch-1 projection's time outside the matmul.
    status = function(
        *row_arguments(x, norm, gated),
        *pointers,
        ins,
        outs,
        y.data_ptr(),
        residual is not None,
        num_threads,
    )
    if status != 0:
        raise MemoryError("the small-batch linear kernel could not allocate its scratch rows")
    return y


def row_arguments(x: torch.Tensor, norm: RMSNorm | None, gated: bool) -> tuple[Any, ...]:
    """The arguments every function of the library starts with: the rows of x, and f."""
    return (
        x.data_ptr(),
        x.shape[0],
        x.stride(0),
        None if norm is None else norm.weight.data_ptr(),
        0.0 if norm is None else norm.eps,
        gated,
    )


def kernel_operands(
    module: nn.Module,
    weight: torch.Tensor,
    x: torch.Tensor,
    norm: RMSNorm | None,
    gated: bool,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x with unit column stride, and y (the residual, or new rows) for one of the library's
    small-batch products of `module`'s `weight` [outs, in]; ValueError when they do not fit."""
    if norm is not None and gated:
        raise ValueError("a projection is normed or gated, not both")
    outs, ins = weight.shape
    width = 2 * ins if gated else ins
    if x.shape[1] != width:
        raise ValueError(f"{module} takes rows of {width} values, got {x.shape[1]}")
    if residual is not None and residual.shape != (x.shape[0], outs):
        raise ValueError(f"residual {tuple(residual.shape)} does not fit {module}")
    if x.stride(1) != 1:
        x = x.contiguous()
    return x, residual if residual is not None else x.new_empty(x.shape[0], outs)


def library_projection_input(
    function: Callable[..., object],
    x: torch.Tensor,
    norm: RMSNorm | None,
    gated: bool,
    num_threads: int,
) -> torch.Tensor:
    """f(x) (the norm, or the SwiGLU when gated) by one of the library's projection-input
    functions, which reads and writes rows of x's dtype (float32: projection_input; bfloat16:
    bfloat16_projection_input)."""
    if norm is not None and gated:
        raise ValueError("a projection is normed or gated, not both")
    if x.stride(1) != 1:
        x = x.contiguous()
    width = x.shape[1] // 2 if gated else x.shape[1]
    out = x.new_empty(x.shape[0], width)
    failed = function(
        *row_arguments(x, norm, gated),
        width,
        out.data_ptr(),
        num_threads,
    )
    if failed:
        raise MemoryError("the projection input could not allocate its scratch rows")
    return out


def transposed_product(
    weight: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T (+ bias) computed as (W x^T)^T. With residual, the product is added into it by
    the matmul itself (residual^T += W x^T). Otherwise returned as the transposed view: copying
    it into rows costs more than its readers lose reading it strided (the SwiGLU's element-wise
    ops, the next transposed product, the sampler, Q/K/V's split). A bias is the matmul's
    broadcast input (one value per output row of W x^T)."""
    if residual is None:
        if bias is None:
            return torch.mm(weight, x.t()).t()
        return torch.addmm(bias.unsqueeze(1), weight, x.t()).t()
    residual.t().addmm_(weight, x.t())
    return residual if bias is None else residual.add_(bias)


class LaidOutLinear(ABC):
    """x W^T on a copy of each weight in the product's own layout, made on first use; a copy
    lives as long as its weight (a second copy of the weights in memory)."""

    def __init__(self, lay_out: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._lay_out = lay_out
        # id of a weight -> its copy; the entry goes when the weight is freed.
        self._copies: dict[int, torch.Tensor] = {}

    @property
    def num_copies(self) -> int:
        return len(self._copies)

    def discard(self, weight: torch.Tensor) -> None:
        """Drops the copy of `weight`, if any (a later use makes it again)."""
        self._copies.pop(id(weight), None)

    def laid_out(self, weight: torch.Tensor) -> torch.Tensor:
        key = id(weight)
        copy = self._copies.get(key)
        if copy is None:
            copy = self._lay_out(weight)
            self._copies[key] = copy
            weakref.finalize(weight, self._copies.pop, key, None)
        return copy

    @abstractmethod
    def __call__(
        self,
        weight: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x W^T + bias (+ residual, added into it)."""


class PackedLinear(LaidOutLinear):
    """x W^T by oneDNN on W reordered once (on first use) into oneDNN's blocked layout."""

    # oneDNN's reorder takes a row count to tune the layout for; on 1 thread it was as fast
    # from 24 to 512 rows whichever of 32, 128 or 512 it was given (measured).
    ROWS_HINT = 128

    def __init__(self) -> None:
        super().__init__(
            lambda weight: torch.ops.mkldnn._reorder_linear_weight(weight, self.ROWS_HINT)
        )

    def __call__(
        self,
        weight: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """oneDNN adds the bias as it writes each output; the residual is added after."""
        y = torch.ops.mkldnn._linear_pointwise(x, self.laid_out(weight), bias, "none", [], "")
        return y if residual is None else residual.add_(y)


class PackedProject:
    """The CPU's Project for a bfloat16 model: every projection (and lm_head) by oneDNN on
    its weight reordered once (PackedLinear), which runs AMX or AVX-512 BF16 code where the
    CPU has them. torch's own bf16 matmul repacks the weight on every call: SmolLM2-135M's
    steps on 2 cores of an Intel Xeon with AMX (family 6 model 167), min of 7, side by side:
    batch-1 decode 0.80x the time, 64-row decode 0.91x, 32-row 0.95x, a 512-token prefill
    1.0x. Its norm or SwiGLU runs in one pass of the small-batch kernel's library where it is
    given (bfloat16_projection_input), else as torch's ops; and where it is given, steps of
    up to small_max_rows rows run there whole (bfloat16_small_batch_linear), the weights
    streamed as they are stored, which oneDNN's code reads far slower at so few rows. Where
    the panel kernel's bfloat16 build is given (AVX-512 BF16), the larger steps run on it
    below the rows from which oneDNN measures faster (`crossover`, calibrated by the
    runner)."""

    def __init__(
        self,
        library: ctypes.CDLL | None = None,
        num_threads: int = 1,
        small_max_rows: int | None = None,
        panels: PanelLinear | None = None,
    ) -> None:
        """small_max_rows: the most rows the library computes whole (by default
        BFLOAT16_SMALL_MAX_ROWS for how the library was built, or
        BFLOAT16_SMALL_MAX_ROWS_BESIDE_PANELS with panels). panels: the panel kernel's
        bfloat16 build, for the larger steps."""
        self.product = PackedLinear()
        self.crossover = (
            None
            if panels is None
            else Crossover(panels, self.product, candidate_rows=BFLOAT16_CANDIDATE_ROWS)
        )
        self.num_threads = num_threads
        if small_max_rows is None and library is not None:
            small_max_rows = (
                BFLOAT16_SMALL_MAX_ROWS[bfloat16_pairs(library)]
                if panels is None
                else BFLOAT16_SMALL_MAX_ROWS_BESIDE_PANELS
            )
        self.small_max_rows = small_max_rows or 0
        self.input_function = None if library is None else library.bfloat16_projection_input
        self.small_function = None if library is None else library.bfloat16_small_batch_linear
        if self.input_function is not None:
            self.input_function.restype = ctypes.c_int
            self.input_function.argtypes = _INPUT_ARGTYPES
        if self.small_function is not None:
            self.small_function.restype = ctypes.c_int
            # weight, bias (or NULL)
            self.small_function.argtypes = small_batch_argtypes(_POINTER, _POINTER)

    def __call__(
        self,
        module: nn.Module,
        x: torch.Tensor,
        *,
        norm: RMSNorm | None = None,
        gated: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if type(module) is not nn.Linear or x.dim() != 2:
            return project_with_torch(module, x, norm=norm, gated=gated, residual=residual)
        weight, bias = module.weight, module.bias
        if self._streams(x, weight, bias, norm, residual):
            return self._stream(module, weight, bias, x, norm, gated, residual)
        x = self.projection_input(x, norm, gated)
        return self._large_product(weight, bias, x, residual)(weight, x, residual, bias)

    def _large_product(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        x: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> LaidOutLinear:
        """The panel kernel where it is given, every operand is bfloat16 and the crossover
        keeps these rows on it; else oneDNN."""
        tensors = (weight, x, bias, residual)
        if self.crossover is None or any(
            t is not None and t.dtype != torch.bfloat16 for t in tensors
        ):
            return self.product
        return self.crossover.product(weight, x.shape[0])

    def layer_projections(self, int8: bool) -> LayerProjections | None:
        """The projections as decode_layers.c runs them, as this Project runs them: the
        library's bfloat16 functions and the panel kernel's bfloat16 build (None without the
        library, or for int8 projections, which it computes with torch)."""
        if self.small_function is None or self.input_function is None or int8:
            return None
        panels = self.crossover.panels if self.crossover is not None else None
        return LayerProjections(
            self.small_function,
            self.small_max_rows,
            self.input_function,
            panels if isinstance(panels, PanelLinear) else None,
            self.num_threads,
        )

    @property
    def streams_weights(self) -> bool:
        """Some steps read the weights as they are stored (place_weights helps them)."""
        return self.small_function is not None and self.small_max_rows > 0

    def _streams(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        norm: RMSNorm | None,
        residual: torch.Tensor | None,
    ) -> bool:
        """Whether the library computes this projection whole: few enough rows, and every
        tensor it reads or writes bfloat16 and laid out as it reads them. (A batch-1 call
        takes ~10 us of Python around the kernel's: the checks stay few.)"""
        bfloat16 = torch.bfloat16
        return (
            x.shape[0] <= self.small_max_rows
            and self.small_function is not None
            and x.dtype == bfloat16
            and weight.dtype == bfloat16
            and weight.is_contiguous()
            and (bias is None or bias.dtype == bfloat16)
            and (norm is None or norm.weight.dtype == bfloat16)
            and (residual is None or (residual.dtype == bfloat16 and residual.is_contiguous()))
        )

    def _stream(
        self,
        module: nn.Linear,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        x: torch.Tensor,
        norm: RMSNorm | None,
        gated: bool,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        assert self.small_function is not None
        pointers = (weight.data_ptr(), None if bias is None else bias.data_ptr())
        return run_small_batch(
            self.small_function,
            module,
            weight,
            pointers,
            x,
            norm,
            gated,
            residual,
            self.num_threads,
        )

    def projection_input(self, x: torch.Tensor, norm: RMSNorm | None, gated: bool) -> torch.Tensor:
        """f(x) of a Project: in one pass of the library for bfloat16 rows, else torch's ops."""
        fused = self.input_function is not None and x.dtype == torch.bfloat16
        if norm is not None:
            fused = fused and norm.weight.dtype == torch.bfloat16
        if not fused or (norm is None and not gated):
            return projection_input(x, norm, gated)
        assert self.input_function is not None
        return library_projection_input(self.input_function, x, norm, gated, self.num_threads)


def choose_bfloat16_project(
    large_mode: str, small_mode: str, device: torch.device, dtype: torch.dtype, num_threads: int
) -> PackedProject | None:
    """PackedProject for a bfloat16 model on the CPU where oneDNN runs bfloat16 products and
    EngineConfig.large_batch_linear leaves the choice to oneDNN ("auto" or "onednn"), its norm
    and SwiGLU in the small-batch kernel's library unless EngineConfig.small_batch_linear is
    "torch" or the library cannot be built; None (torch's ops) otherwise. ValueError where
    "onednn" is asked for and oneDNN has no bfloat16 products here."""
    applies = device.type == "cpu" and dtype == torch.bfloat16
    if not applies or large_mode not in ("auto", "onednn"):
        return None
    if not onednn_bfloat16_available():
        if large_mode == "onednn":
            raise ValueError(
                "large_batch_linear='onednn' for a bfloat16 model needs oneDNN's bfloat16 "
                "products, which this CPU lacks (AVX-512 or AVX-NE-CONVERT)"
            )
        # SmolLM2-135M on an AMD EPYC Zen 3: a 32-row decode step 6.6x float32's time, a
        # 128-token prefill 8.1x.
        logger.warning(
            "bfloat16 runs on torch's matmul here (no AVX-512 or AVX-NE-CONVERT for oneDNN's "
            "bfloat16 products): several times slower than float32, the default"
        )
        return None
    library = choose_kernel(
        small_mode,
        "torch",
        device,
        dtype,
        lambda: load_library("small_batch_linear"),
        dtypes=(torch.bfloat16,),
    )
    panels = bfloat16_panels(num_threads) if large_mode == "auto" else None
    return PackedProject(library, num_threads, panels=panels)


def bfloat16_panels(num_threads: int, prefetch: bool | None = None) -> PanelLinear | None:
    """The panel kernel's bfloat16 build where the kernels are built for AVX-512 BF16, else
    None (oneDNN alone; a panel library that cannot be built is logged by the float32
    models' choice, not here). prefetch: its streaming variant; None: where float32's
    streams by default (PREFETCH_BY_DEFAULT; measured faster in bfloat16 on an Intel Xeon,
    kernels/panel_linear.c)."""
    try:
        library = panel_library()
    except KernelUnavailable:
        return None
    library.panel_linear_bfloat16_built.restype = ctypes.c_int
    if not library.panel_linear_bfloat16_built():
        return None
    library.panel_linear_bfloat16_tiles.restype = ctypes.c_int
    if library.panel_linear_bfloat16_tiles() < 0:
        logger.warning("the panel kernel without AMX tiles: Linux refused them to this process")
        library = panel_library(tiles=False)
    if prefetch is None:
        prefetch = (cpu_vendor(), 16) in PREFETCH_BY_DEFAULT  # an AVX-512 build: 16 lanes
    return PanelLinear(library, num_threads, prefetch, torch.bfloat16)


class PanelLinear(LaidOutLinear):
    """x W^T by the panel kernel (kernels/panel_linear.c) on W packed once (on first use)
    into panels of output columns."""

    def __init__(
        self,
        library: ctypes.CDLL,
        num_threads: int,
        prefetch: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """prefetch: the kernel's streaming variant (panel_linear_prefetching, or
        panel_linear_bfloat16_prefetching): each thread asks for its next panel while it runs
        the current one, and the rows go in blocks that stay in L2. dtype: the operands',
        float32 or bfloat16 (the kernel's build for a bfloat16 model, panel_linear_bfloat16:
        AVX-512 BF16 only; its panels hold pairs of inputs, an odd count padded)."""
        bfloat16 = dtype == torch.bfloat16
        self.prefetch = prefetch
        if bfloat16:
            self.function = (
                library.panel_linear_bfloat16_prefetching
                if prefetch
                else library.panel_linear_bfloat16
            )
        else:
            self.function = library.panel_linear_prefetching if prefetch else library.panel_linear
        self.function.restype = None
        self.function.argtypes = [
            *(_POINTER, _INT, _INT, _INT),  # x, rows, x row stride, ins
            *(_POINTER, _POINTER, _INT),  # panels, bias (or NULL), outs
            *(_POINTER, ctypes.c_int, ctypes.c_int),  # y, accumulate, threads
        ]
        pack = library.panel_linear_bfloat16_pack if bfloat16 else library.panel_linear_pack
        pack.restype = None
        pack.argtypes = [_POINTER, _INT, _INT, _POINTER]  # weight, outs, ins, panels
        library.panel_linear_width.restype = ctypes.c_int
        width = library.panel_linear_width()
        depth_of = library.panel_linear_bfloat16_depth if bfloat16 else None
        if depth_of is not None:
            depth_of.restype = _INT
            depth_of.argtypes = [_INT]

        def packed(weight: torch.Tensor) -> torch.Tensor:
            outs, ins = weight.shape
            depth = depth_of(ins) if depth_of is not None else ins
            panels = weight.new_empty(-(-outs // width) * depth * width)
            pack(weight.contiguous().data_ptr(), outs, ins, panels.data_ptr())
            return panels

        super().__init__(packed)
        self.num_threads = num_threads

    def __call__(
        self,
        weight: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The kernel adds the bias, and the residual in place where it is contiguous."""
        outs, ins = weight.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        into = residual is not None and residual.is_contiguous()
        y = residual if residual is not None and into else x.new_empty(x.shape[0], outs)
        self.function(
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            ins,
            self.laid_out(weight).data_ptr(),
            None if bias is None else bias.data_ptr(),
            outs,
            y.data_ptr(),
            into,
            self.num_threads,
        )
        if residual is None or into:
            return y
        return residual.add_(y)


def place_weights(model: nn.Module) -> None:
    """Moves the weights the kernel streams (every projection kernel_weights names, tied ones
    once) into one buffer on huge pages (huge_pages.py), in the order a step reads them, each
    starting on a cache line: SmolLM2-135M's batch-1 projections took 8-10% less kernel time
    per step on 2 MiB pages (AMD EPYC Zen 4, 2 cores, steps alternated between a placed and an
    unplaced copy in one process). Once per model."""
    if model in _PLACED:
        return
    tensors: dict[int, torch.Tensor] = {}
    for module in model.modules():
        weights = kernel_weights(module)
        if weights is not None:
            tensors.setdefault(weights[0].data_ptr(), weights[0])
    line = 64
    offsets, total = [], 0
    for tensor in tensors.values():
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // line) * line
    if total:
        memory = huge_page_bytes(total, populate=True)
        for tensor, offset in zip(tensors.values(), offsets, strict=True):
            size = tensor.numel() * tensor.element_size()
            placed = memory[offset : offset + size].view(tensor.dtype).view(tensor.shape)
            tensor.data = placed.copy_(tensor)
    _PLACED.add(model)


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available())


def onednn_bfloat16_available() -> bool:
    """Whether oneDNN runs bfloat16 products on this CPU: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and refuses to lay out a bfloat16 weight on AVX2 alone."""
    return onednn_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def kernel_weights(
    module: nn.Module,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """(weight, bfloat16 scales for int8 weights, bias) of a projection the kernel computes, or
    None. The tensors are on the CPU: the engine only chooses the kernel for a CPU model
    (float32, or bfloat16 on its bfloat16 builds)."""
    if type(module) is nn.Linear:
        if module.weight.is_contiguous():
            return module.weight, None, module.bias
    elif type(module) is Int8Linear:
        return module.weight_int8, module.scales, module.bias
    return None


def choose_linear_kernel(
    mode: str,
    device: torch.device,
    dtype: torch.dtype,
    num_threads: int,
    large_mode: str = "auto",
) -> SmallBatchLinear | None:
    """The kernel for EngineConfig.small_batch_linear ("auto" | "kernel" | "torch"), or None
    for torch's matmul (see kernel_build.choose_kernel), its larger steps on the product
    EngineConfig.large_batch_linear names (large_product)."""
    if large_mode == "onednn" and not onednn_available():
        raise ValueError("large_batch_linear='onednn' needs a torch built with oneDNN")
    return choose_kernel(
        mode, "torch", device, dtype, lambda: load_linear_kernel(num_threads, large_mode)
    )


@functools.cache
def load_linear_kernel(num_threads: int, large_mode: str = "torch") -> SmallBatchLinear:
    """The kernel, compiled on first use (KernelUnavailable when it cannot be), its larger
    steps on large_product(large_mode)."""
    library = load_library("small_batch_linear")
    large = large_product(large_mode, kernel_lanes(library), num_threads)
    # "auto" measures where oneDNN overtakes the panel kernel; a mode named runs as named.
    measured = large_mode == "auto" and onednn_available()
    crossover = (
        Crossover(large, PackedLinear()) if measured and isinstance(large, PanelLinear) else None
    )
    return SmallBatchLinear(library, num_threads, large=large, crossover=crossover)


def panel_library(tiles: bool | None = None) -> ctypes.CDLL:
    """The panel kernel's library, built for this CPU's vendor (EVEN_TILES_VENDORS,
    BFLOAT16_FMA_VENDORS) and, with tiles, its AMX_TILES build: a bfloat16 model's products on
    AMX tiles (on an FMA vendor in place of the FMA build); None: where the CPU has AMX-BF16."""
    if tiles is None:
        tiles = cpu_has_amx()
    vendor = cpu_vendor()
    defines = [name for name, vendors in PANEL_BUILDS.items() if vendor in vendors]
    if tiles:
        defines = [name for name in defines if name != "BFLOAT16_FMA"] + ["AMX_TILES"]
    return load_library("panel_linear", tuple(defines))


def large_product(mode: str, lanes: int, num_threads: int) -> LaidOutLinear | None:
    """The product of the larger steps for EngineConfig.large_batch_linear: "panels" the panel
    kernel ("panels-prefetch" prefetching), "onednn" PackedLinear, "torch" None (torch's
    products); "auto" the panel kernel where the kernels' vectors are PANELS_BY_DEFAULT_LANES
    floats wide (prefetching on the PREFETCH_BY_DEFAULT CPUs; load_linear_kernel adds oneDNN
    from the rows it measures faster, linear_crossover.py), else oneDNN where torch has
    it."""
    if mode == "auto":
        prefetch = (cpu_vendor(), lanes) in PREFETCH_BY_DEFAULT
        panels = "panels-prefetch" if prefetch else "panels"
        default = "onednn" if onednn_available() else "torch"
        mode = panels if lanes in PANELS_BY_DEFAULT_LANES else default
    if mode in ("panels", "panels-prefetch"):
        return PanelLinear(panel_library(), num_threads, mode == "panels-prefetch")
    return PackedLinear() if mode == "onednn" else None


def bfloat16_pairs(library: ctypes.CDLL) -> bool:
    """Whether the small-batch kernel meets a bfloat16 model's weights as bfloat16 pairs
    (AVX-512 BF16), as built for this CPU."""
    library.bfloat16_small_batch_pairs.restype = ctypes.c_int
    return bool(library.bfloat16_small_batch_pairs())


def kernel_lanes(library: ctypes.CDLL) -> int:
    """The floats in the small-batch kernel's vectors, as built for this CPU."""
    library.small_batch_linear_lanes.restype = ctypes.c_int
    return int(library.small_batch_linear_lanes())
