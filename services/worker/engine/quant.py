"""int8 weight-only quantization: symmetric, one scale per output channel.

Applied at load time to the attention and MLP projections; embeddings, norms and the LM head
stay in floating point. On CPU, steps of a few rows (batch-1 decode and the like) go through the
small-batch kernel (linear_kernel.py), which reads the int8 weights and their scales directly,
with float32 activations. Bigger batches use torch's `_weight_int8pack_mm`, which also reads
the int8 weights directly: on an AVX-512 Xeon ~4x faster than an fp32 matmul at batch 1 when
fed bf16 activations, and about as fast as fp32 at batch 32; with fp32 activations it is
slower than fp32. So activations go through bf16 for it and come back in the model dtype.
Devices without that kernel (CUDA in current torch builds) dequantize each weight per matmul:
correct, half the resident weight memory, but no faster than bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.models.llama import LlamaModel

QUANTIZED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
INT8_MAX = 127


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (int8 weight, scale per output row) with w ~= q * scale.

    Scales are rounded to bf16 (the kernel's scale dtype) before quantizing, so q is the best
    int8 approximation under the scale actually used."""
    w = weight.float()
    scale = (w.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX).to(torch.bfloat16).float()
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T without materializing the float weight."""

    weight_int8: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None  # kept in floating point (Qwen2's Q/K/V)
    in_features: int
    out_features: int
    packed_kernel: bool  # torch has _weight_int8pack_mm for this device

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, scale = quantize_per_channel(linear.weight.detach())
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("weight_int8", q)
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.packed_kernel = q.device.type == "cpu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed_kernel:
            weight = self.weight_int8.to(x.dtype) * self.scales.to(x.dtype)[:, None]
            return F.linear(x, weight, self.bias)
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out.add_(self.bias)


def quantize_model_int8(model: LlamaModel) -> None:
    """Swap every layer's projections for Int8Linear, in place."""
    for layer in model.decoder_layers():
        for name in QUANTIZED_PROJECTIONS:
            linear = getattr(layer, name)
            setattr(layer, name, Int8Linear(linear))
