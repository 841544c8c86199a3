"""All decoder layers of a step in one C call (kernels/decode_layers.c).

At batch 1 the kernels themselves (projections, RoPE + K/V store, attention) took 25 of a
33.9 ms step and the Python around them, layer after layer, the other 8.8 ms on one thread
(SmolLM2-135M, 2 cores of an Intel Xeon). decode_layers.c calls the same kernels in the same
order with the same arguments, so a step's numbers are bit for bit those of the layer-by-layer
path; it runs a step that holds only decode rows of a model whose layers it can express (no
per-head Q/K norm, every projection a matrix the kernel reads: float32 or int8, or bfloat16 in
its build for a bfloat16 model): up to the small-batch linear kernel's rows, and up to
FUSED_MAX_ROWS where the larger steps' projections run on the panel kernel (PanelLinear:
decode_layers.c calls it as that path does). Such a step is tens of milliseconds: it is not
interrupted between layers (an interactive arrival waits at most that). Where the larger
steps run on panels and a prefill kernel is given, it also runs steps with prefill chunks
(each chunk's attention on that kernel), of any rows: those that nothing may interrupt
between layers (the runner's choice).
"""

from __future__ import annotations

import ctypes
import functools
from typing import TypeGuard

import torch

from services.worker.engine.attention import KernelDecode, LayerKvCache, PrefillSpan
from services.worker.engine.decode_kernel import DecodeKernel
from services.worker.engine.kernel_build import KV_BUILDS, load_library
from services.worker.engine.linear_kernel import LayerProjections, PanelLinear, kernel_weights
from services.worker.engine.models.llama import LlamaLayer, LlamaModel
from services.worker.engine.prefill_kernel import PrefillKernel
from services.worker.engine.rope_store_kernel import RopeStoreKernel

_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64
# The most rows of a fused step on the panel kernel: the engine's default max_num_seqs, so
# every decode-only step of the default engine is one call; a larger step is long enough that
# an interactive arrival should not wait for all its layers (it runs layer by layer).
FUSED_MAX_ROWS = 64


class _Projection(ctypes.Structure):
    _fields_ = [
        ("weight", _POINTER),
        ("scales", _POINTER),
        ("bias", _POINTER),
        ("panels", _POINTER),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _POINTER),
        ("post_attention_norm", _POINTER),
        ("qkv", _Projection),
        ("o", _Projection),
        ("gate_up", _Projection),
        ("down", _Projection),
        ("key_cache", _POINTER),
        ("value_cache", _POINTER),
    ]


class _Chunk(ctypes.Structure):
    _fields_ = [
        ("row_start", _INT),
        ("rows", _INT),
        ("prefix_len", _INT),
        ("block_table", _POINTER),
        ("want_logits", _INT),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("linear", _POINTER),
        ("rope_store", _POINTER),
        ("attention", _POINTER),
        ("prefill_attention", _POINTER),
        ("projection_input", _POINTER),
        ("panel_linear", _POINTER),
        ("small_rows", _INT),
        ("hidden", _INT),
        ("heads", _INT),
        ("kv_heads", _INT),
        ("head_dim", _INT),
        ("intermediate", _INT),
        ("block_size", _INT),
        ("window", _INT),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("threads", ctypes.c_int),
    ]


class DecodeLayers:
    """The decoder layers of one model over its KV cache, as one call per step."""

    def __init__(
        self,
        library: ctypes.CDLL,
        model: LlamaModel,
        layer_caches: list[LayerKvCache],
        block_size: int,
        kernels: tuple[LayerProjections, RopeStoreKernel, DecodeKernel],
        prefill: PrefillKernel | None = None,
    ) -> None:
        """The model's weights and cache are read by address from here on: they must stay
        where they are (the runner places the weights before it builds this). library: the
        build for the model's dtype (decode_layers_library); kernels: the projections, RoPE/
        store and decode attention of that dtype; prefill: the kernel that attends prefill
        chunks, for steps that have them."""
        projections, rope_store, attention = kernels
        config = model.config
        layers = model.decoder_layers()
        panels = projections.panels
        self.max_rows = FUSED_MAX_ROWS if panels is not None else projections.small_rows
        """The most rows of a decode-only step it runs."""
        self.runs_prefills = prefill is not None and panels is not None
        """Whether it runs steps with prefill chunks (any rows: their projections on panels)."""
        self._function = library.decode_layers
        self._function.restype = ctypes.c_int
        # model, layers, layers' count, hidden, rows, rotations, slots, decode rows, their
        # block tables, context lengths and blocks each, chunks, chunks' count
        self._function.argtypes = [_POINTER, _POINTER, _INT, _POINTER, _INT, _POINTER, _POINTER]
        self._function.argtypes += [_INT, _POINTER, _POINTER, _INT, _POINTER, _INT]
        self._model = _Model(
            linear=ctypes.cast(projections.small, _POINTER).value,
            rope_store=ctypes.cast(rope_store.function, _POINTER).value,
            attention=ctypes.cast(attention.function, _POINTER).value,
            prefill_attention=None
            if prefill is None
            else ctypes.cast(prefill.function, _POINTER).value,
            projection_input=ctypes.cast(projections.input, _POINTER).value,
            panel_linear=None if panels is None else ctypes.cast(panels.function, _POINTER).value,
            small_rows=projections.small_rows,
            hidden=config.hidden_size,
            heads=config.num_heads,
            kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate=config.intermediate_size,
            block_size=block_size,
            window=config.sliding_window or 0,
            eps=config.rms_norm_eps,
            scale=config.head_dim**-0.5,
            threads=projections.threads,
        )
        table = (_Layer * len(layers))()
        for entry, layer, cache in zip(table, layers, layer_caches, strict=True):
            entry.input_norm = layer.input_norm.weight.data_ptr()
            entry.post_attention_norm = layer.post_attention_norm.weight.data_ptr()
            entry.qkv, entry.o, entry.gate_up, entry.down = (
                _projection(m, panels) for m in layer_projections(layer)
            )
            entry.key_cache = cache.key_blocks.data_ptr()
            entry.value_cache = cache.value_blocks.data_ptr()
        self._layers = table
        self._num_layers = len(layers)

    def __call__(
        self,
        hidden: torch.Tensor,
        rotations: torch.Tensor,
        slots: torch.Tensor,
        decode: KernelDecode | None,
        prefills: list[PrefillSpan],
    ) -> torch.Tensor:
        """hidden [rows, hidden] contiguous (updated in place and returned); rotations [rows,
        1, head_dim / 2] complex; slots [rows] int64; decode: the first rows' (block tables
        and context lengths contiguous int64), prefills: the chunks after them, as the runner
        plans them (only where runs_prefills). The caller guarantees the shapes. With
        prefills, only the first rows of the result are output: those of the step's
        LastLayerRows, in its order (the last layer computes no other)."""
        pairs = torch.view_as_real(rotations).contiguous()
        tables = [span.block_ids.contiguous() for span in prefills]  # held: read by address
        chunks = (
            (_Chunk * len(prefills))(
                *(
                    _Chunk(
                        span.row_start,
                        span.row_end - span.row_start,
                        span.prefix_len,
                        t.data_ptr(),
                        span.want_logits,
                    )
                    for span, t in zip(prefills, tables, strict=True)
                )
            )
            if prefills
            else None  # a decode step: nothing to build
        )
        status = self._function(
            ctypes.byref(self._model),
            self._layers,
            self._num_layers,
            hidden.data_ptr(),
            hidden.shape[0],
            pairs.data_ptr(),
            slots.data_ptr(),
            0 if decode is None else decode.rows,
            None if decode is None else decode.block_tables.data_ptr(),
            None if decode is None else decode.context_lens.data_ptr(),
            0 if decode is None else decode.block_tables.shape[1],
            chunks,
            len(prefills),
        )
        if status != 0:
            raise MemoryError("the decode-layers kernel could not allocate its scratch memory")
        return hidden


def layer_projections(layer: LlamaLayer) -> tuple[torch.nn.Module, ...]:
    """A layer's projections, in the order decode_layers.c's Layer holds them."""
    return layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj


def int8_projections(model: LlamaModel) -> bool:
    """Whether any of the model's layer projections holds int8 weights (the panel kernel
    takes none)."""
    return any(_int8(m) for layer in model.decoder_layers() for m in layer_projections(layer))


def _int8(module: torch.nn.Module) -> bool:
    weights = kernel_weights(module)
    return weights is not None and weights[1] is not None


def _projection(module: torch.nn.Module, panels: PanelLinear | None) -> _Projection:
    """A projection's weights for the small-batch kernel, and packed for the panel kernel
    when the larger steps run on it (the packed copy that path uses)."""
    weights = kernel_weights(module)
    if weights is None:
        raise ValueError(f"{module} is not a projection the small-batch kernel reads")
    weight, scales, bias = weights
    return _Projection(
        weight=weight.data_ptr(),
        scales=None if scales is None else scales.data_ptr(),
        bias=None if bias is None else bias.data_ptr(),
        panels=None if panels is None else panels.laid_out(weight).data_ptr(),
    )


def expressible(model: torch.nn.Module) -> TypeGuard[LlamaModel]:
    """Whether decode_layers.c computes this model's layers: Llama-family layers without a
    per-head Q/K norm, every projection one the small-batch kernel reads."""
    if not isinstance(model, LlamaModel):
        return False
    layers = model.decoder_layers()
    return len(layers) == len(model.layers) and all(
        layer.q_norm is None
        and all(kernel_weights(m) is not None for m in layer_projections(layer))
        for layer in layers
    )


@functools.cache
def decode_layers_library(dtype: torch.dtype = torch.float32) -> ctypes.CDLL:
    """kernels/decode_layers.c built for a model of `dtype` (float32 or bfloat16), compiled on
    first use (KernelUnavailable when it cannot be)."""
    return load_library("decode_layers", KV_BUILDS[dtype])
