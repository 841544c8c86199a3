"""The Llama-style decoder in plain PyTorch, reading and writing a paged KV cache.

Covers Llama 2/3, SmolLM2 and the families that differ from it only in a few switches of
ModelConfig (models/registry.py names them): RMSNorm, rotary embeddings (default, linear and
the Llama-3 "llama3" scaling), grouped-query attention, SwiGLU MLP, tied or untied embeddings;
optionally a bias on Q/K/V (Qwen2), an RMSNorm over each head of Q and K (Qwen3) and a sliding
attention window (Mistral). Q/K/V and gate/up projections are fused into one matmul each (done
by the loader) because at batch 1 every extra kernel launch is overhead on top of the weight
reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.attention import (
    AttentionBatch,
    LastLayerRows,
    LayerKvCache,
    paged_attention,
    store_kv,
)
from services.worker.engine.models import StepInterrupted
from services.worker.engine.models.family import ModelFamily

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class Project(Protocol):
    """How the model's projections run (project_with_torch, or linear_kernel.SmallBatchLinear,
    which fuses the element-wise work around a projection into its matmul).

    module(f(x)) for x [rows, in], where f is `norm` when given, SwiGLU when gated (x is
    [gate | up], overwritten), else nothing; with `residual` the product is added into it in
    place and the residual is returned. The result may be a strided view of its rows."""

    def __call__(
        self,
        module: nn.Module,
        x: torch.Tensor,
        *,
        norm: RMSNorm | None = None,
        gated: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


def project_with_torch(
    module: nn.Module,
    x: torch.Tensor,
    *,
    norm: RMSNorm | None = None,
    gated: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Project every device has: torch ops, one after another."""
    x = projection_input(x, norm, gated)
    if residual is not None and type(module) is nn.Linear and module.bias is None:
        # The matmul adds its product into the residual as it writes it (beta = 1): no
        # product tensor to write and read back.
        return residual.addmm_(x, module.weight.t())
    y = module(x)
    return y if residual is None else residual.add_(y)


def projection_input(x: torch.Tensor, norm: RMSNorm | None, gated: bool) -> torch.Tensor:
    """f(x) of a Project, computed with torch ops."""
    if norm is not None:
        return norm(x)
    if gated:
        gate, up = x.chunk(2, dim=-1)
        # In place: the gate/up activations are a layer's largest temporaries.
        return F.silu(gate, inplace=True).mul_(up)
    return x


@dataclass(slots=True, frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # The Hugging Face names of the family (config.json's architectures[0] and model_type).
    architecture: str = "LlamaForCausalLM"
    model_type: str = "llama"
    qkv_bias: bool = False  # Q/K/V projections have a bias (Qwen2)
    qk_norm: bool = False  # Q and K are RMS-normed per head before RoPE (Qwen3)
    # Each token attends to at most this many latest tokens, its own included (Mistral);
    # None: to all of them.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        rope_type = rope_type_of(self.rope_scaling)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face config fields of its family (legacy rope keys, which every version
        reads)."""
        family_fields: dict[str, Any] = {"sliding_window": self.sliding_window}
        if self.model_type == "llama":
            family_fields = {"attention_bias": False, "mlp_bias": False}
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        } | family_fields

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], **family: Any) -> ModelConfig:
        """Read a Hugging Face config.json (transformers 4.x `rope_scaling`/`rope_theta` keys or
        5.x `rope_parameters`); `family` sets the fields a family's config reader decides
        (architecture, model_type, qkv_bias, qk_norm, sliding_window). Raises KeyError naming a
        missing field, ValueError otherwise."""
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r} (only silu)")
        rope_parameters = raw.get("rope_parameters")
        if isinstance(rope_parameters, dict):
            rope_theta = float(rope_parameters.get("rope_theta", raw.get("rope_theta", 10000.0)))
            scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
        else:
            rope_theta = float(raw.get("rope_theta", 10000.0))
            scaling = dict(raw.get("rope_scaling") or {})
        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rope_theta=rope_theta,
            rope_scaling=normalize_rope_scaling(scaling),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            **family,
        )

    def window_of(self, context: int) -> int | None:
        """The sliding window when it is shorter than `context` (so it hides some tokens)."""
        window = self.sliding_window
        return window if window is not None and window < context else None


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def normalize_rope_scaling(scaling: dict[str, Any]) -> dict[str, Any] | None:
    """None for plain RoPE; otherwise the dict with its type under "rope_type"."""
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return None
    normalized = {k: v for k, v in scaling.items() if k != "type"}
    normalized["rope_type"] = rope_type
    return normalized


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies, computed exactly as transformers does (on the CPU, also
    while the model is being built on the meta device)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    rope_type = rope_type_of(scaling)
    if scaling is None or rope_type == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    # Llama 3: long wavelengths slowed by `factor`, short kept, a smooth ramp in between.
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTables(nn.Module):
    """e^(i * position * frequency) for every position and rotary pair.

    Q/K rows are stored with each rotary pair (d, d + head_dim/2) in adjacent dims (the
    "interleaved" order llama.cpp uses too; see interleave_rope_rows), so applying RoPE is one
    complex multiply instead of the three kernels of the half-split formulation. Attention is
    unchanged because Q and K share the permutation."""

    rotations: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device="cpu")
        angles = torch.outer(positions, inv_freq)
        self.register_buffer(
            "rotations", torch.polar(torch.ones_like(angles), angles), persistent=False
        )

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, 1, head_dim / 2] complex rotations for the given positions."""
        return self.rotations[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] in interleaved pair order -> rotated copy (same dtype)."""
    pairs = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rotations).flatten(-2).to(x.dtype)


def rotate_and_store(
    qkv: torch.Tensor,
    num_heads: int,
    rotations: torch.Tensor,
    cache: LayerKvCache,
    batch: AttentionBatch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, heads + 2 * kv_heads, dim] contiguous -> (q, k, v) with RoPE applied to q and
    k, and k and v written into the cache (by the batch's kernel in one pass where it has one,
    rotating qkv in place)."""
    rotated_heads = num_heads + (qkv.shape[1] - num_heads) // 2  # Q and K
    values = qkv[:, rotated_heads:]
    if batch.rope_store is not None:
        batch.rope_store(qkv, num_heads, rotations, batch.slots, cache.key_slots, cache.value_slots)
        rotated = qkv[:, :rotated_heads]
    else:
        rotated = apply_rope(qkv[:, :rotated_heads], rotations)
        store_kv(rotated[:, num_heads:], values, cache, batch)
    return rotated[:, :num_heads], rotated[:, num_heads:], values


def interleave_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Hugging Face Q/K rows (each head: first halves, then second halves of the rotary pairs)
    -> pairs adjacent. The same permutation llama.cpp applies when it writes a GGUF."""
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, 2, half, cols).transpose(1, 2).reshape(rows, cols)


def split_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of interleave_rope_rows (also turns GGUF Q/K back into Hugging Face order)."""
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, as torch's fused CPU/CUDA kernel (one pass over the
    rows; transformers' formula, in the same order)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class LlamaLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        # Over head_dim, in the interleaved rotary order of the Q/K rows (see fuse_hf_weights).
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,
        rotations: torch.Tensor,
        kv_cache: LayerKvCache,
        batch: AttentionBatch,
        project: Project,
        kept: LastLayerRows | None = None,
    ) -> torch.Tensor:
        """hidden [T, hidden_size] -> the layer's output (computed in place into `hidden`);
        with `kept` (the last layer), only its rows' output, once every row's K/V is stored."""
        tokens = hidden.shape[0]
        # Contiguous: a Project may return the rows as a strided view, and RoPE pairs up
        # adjacent head dims.
        qkv = (
            project(self.qkv_proj, hidden, norm=self.input_norm)
            .contiguous()
            .view(tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        )
        if self.q_norm is not None and self.k_norm is not None:
            qkv[:, : self.num_heads] = self.q_norm(qkv[:, : self.num_heads])
            heads = slice(self.num_heads, self.num_heads + self.num_kv_heads)
            qkv[:, heads] = self.k_norm(qkv[:, heads])
        q, k, v = rotate_and_store(qkv, self.num_heads, rotations, kv_cache, batch)
        if kept is not None:
            rows, batch = kept.rows, kept.attention
            q, k, v, hidden = q[rows], k[rows], v[rows], hidden[rows]
            tokens = hidden.shape[0]
            if tokens == 0:  # no row's logits wanted (a chunk short of its prompt's end)
                return hidden
        attn = paged_attention(q, k, v, kv_cache, batch)
        project(self.o_proj, attn.reshape(tokens, -1), residual=hidden)
        gate_up = project(self.gate_up_proj, hidden, norm=self.post_attention_norm)
        return project(self.down_proj, gate_up, gated=True, residual=hidden)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # An explicit _weight skips nn.Embedding's random init (slow on the meta device).
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(LlamaLayer(config) for _ in range(config.num_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryTables(config)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKvCache],
        batch: AttentionBatch,
        interrupt: Callable[[], bool] | None = None,
        project: Project = project_with_torch,
        last_layer_rows: LastLayerRows | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden_size] after the last layer (before the final norm); with
        last_layer_rows, only those rows' [kept, hidden_size].

        interrupt is asked before every layer; when it says True the pass stops with
        StepInterrupted (the KV it wrote so far belongs to tokens not yet computed).
        project runs the layers' projections."""
        hidden = self.embed_tokens(token_ids)
        rotations = self.rotary.lookup(positions)
        last = len(self.layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if interrupt is not None and interrupt():
                raise StepInterrupted
            kept = last_layer_rows if index == last else None
            hidden = layer(hidden, rotations, kv_cache, batch, project, kept)
        return hidden

    def decoder_layers(self) -> list[LlamaLayer]:
        return [layer for layer in self.layers if isinstance(layer, LlamaLayer)]

    @classmethod
    def from_parameters(
        cls,
        config: ModelConfig,
        parameters: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> LlamaModel:
        """Build the model from its parameters (a family's weight_mapping of the Hugging Face
        weights) without ever initializing random weights. RuntimeError names a missing or
        misshapen one."""
        with torch.device("meta"):
            model = cls(config)
        placed = {
            name: tensor.to(device=device, dtype=dtype) for name, tensor in parameters.items()
        }
        model.load_state_dict(placed, strict=True, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.rotary.to(device)
        return model.eval()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under Hugging Face names: Q/K/V and gate/up split again, Q/K rows (and
        their bias and norm weights) back in half-split rotary order."""
        config = self.config
        sizes = qkv_sizes(config)
        state = {"model.embed_tokens.weight": self.embed_tokens.weight.detach()}
        for i, layer in enumerate(self.decoder_layers()):
            prefix = f"model.layers.{i}."
            attn = prefix + "self_attn."
            q, k, v = layer.qkv_proj.weight.detach().split(sizes)
            gate, up = layer.gate_up_proj.weight.detach().chunk(2)
            state |= {
                prefix + "input_layernorm.weight": layer.input_norm.weight.detach(),
                attn + "q_proj.weight": split_rope_rows(q, config.num_heads),
                attn + "k_proj.weight": split_rope_rows(k, config.num_kv_heads),
                attn + "v_proj.weight": v,
                attn + "o_proj.weight": layer.o_proj.weight.detach(),
                prefix
                + "post_attention_layernorm.weight": layer.post_attention_norm.weight.detach(),
                prefix + "mlp.gate_proj.weight": gate,
                prefix + "mlp.up_proj.weight": up,
                prefix + "mlp.down_proj.weight": layer.down_proj.weight.detach(),
            }
            if layer.qkv_proj.bias is not None:
                q_bias, k_bias, v_bias = layer.qkv_proj.bias.detach().split(sizes)
                state |= {
                    attn + "q_proj.bias": split_rope_vector(q_bias, config.num_heads),
                    attn + "k_proj.bias": split_rope_vector(k_bias, config.num_kv_heads),
                    attn + "v_proj.bias": v_bias,
                }
            if layer.q_norm is not None and layer.k_norm is not None:
                state |= {
                    attn + "q_norm.weight": split_rope_vector(layer.q_norm.weight.detach(), 1),
                    attn + "k_norm.weight": split_rope_vector(layer.k_norm.weight.detach(), 1),
                }
        state["model.norm.weight"] = self.final_norm.weight.detach()
        if not config.tie_word_embeddings:
            state["lm_head.weight"] = self.lm_head.weight.detach()
        return state

    def compute_logits(
        self, hidden: torch.Tensor, project: Project = project_with_torch
    ) -> torch.Tensor:
        """fp32 logits for the given rows of final hidden states."""
        # Contiguous: the sampler reduces along each row.
        return project(self.lm_head, hidden, norm=self.final_norm).float().contiguous()


def qkv_sizes(config: ModelConfig) -> list[int]:
    """Rows of Q, K and V in the fused qkv_proj."""
    kv_size = config.num_kv_heads * config.head_dim
    return [config.num_heads * config.head_dim, kv_size, kv_size]


def interleave_rope_vector(vector: torch.Tensor, num_heads: int) -> torch.Tensor:
    """interleave_rope_rows for a bias or a per-head norm weight: one value per Q/K row, so it
    takes the same reordering as the rows (or it would be added to the wrong dims)."""
    return interleave_rope_rows(vector[:, None], num_heads)[:, 0]


def split_rope_vector(vector: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of interleave_rope_vector."""
    return split_rope_rows(vector[:, None], num_heads)[:, 0]


def fuse_hf_weights(config: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face Llama-style weights -> this module's parameters (fused projections,
    interleaved rotary rows, with the Q/K/V bias and the Q/K norms of the families that have
    them). KeyError names a missing weight."""
    fused = {
        "embed_tokens.weight": hf["model.embed_tokens.weight"],
        "final_norm.weight": hf["model.norm.weight"],
        "lm_head.weight": hf["model.embed_tokens.weight"]
        if config.tie_word_embeddings
        else hf["lm_head.weight"],
    }
    for i in range(config.num_layers):
        src = f"model.layers.{i}."
        dst = f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        fused |= {
            dst + "input_norm.weight": hf[src + "input_layernorm.weight"],
            dst + "qkv_proj.weight": torch.cat(
                [
                    interleave_rope_rows(hf[attn + "q_proj.weight"], config.num_heads),
                    interleave_rope_rows(hf[attn + "k_proj.weight"], config.num_kv_heads),
                    hf[attn + "v_proj.weight"],
                ]
            ),
            dst + "o_proj.weight": hf[attn + "o_proj.weight"],
            dst + "post_attention_norm.weight": hf[src + "post_attention_layernorm.weight"],
            dst + "gate_up_proj.weight": torch.cat(
                [hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]]
            ),
            dst + "down_proj.weight": hf[mlp + "down_proj.weight"],
        }
        if config.qkv_bias:
            fused[dst + "qkv_proj.bias"] = torch.cat(
                [
                    interleave_rope_vector(hf[attn + "q_proj.bias"], config.num_heads),
                    interleave_rope_vector(hf[attn + "k_proj.bias"], config.num_kv_heads),
                    hf[attn + "v_proj.bias"],
                ]
            )
        if config.qk_norm:
            fused[dst + "q_norm.weight"] = interleave_rope_vector(hf[attn + "q_norm.weight"], 1)
            fused[dst + "k_norm.weight"] = interleave_rope_vector(hf[attn + "k_norm.weight"], 1)
    return fused


def read_llama_config(raw: dict[str, Any]) -> ModelConfig:
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias Llama checkpoints are not supported")
    return ModelConfig.from_hf_dict(raw)


FAMILY = ModelFamily(
    architecture="LlamaForCausalLM",
    model_type="llama",
    gguf_architecture="llama",
    gguf_rope_rows_interleaved=True,
    read_config=read_llama_config,
    model_class=LlamaModel,
    weight_mapping=fuse_hf_weights,
)
