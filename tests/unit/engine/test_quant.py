"""int8 weight-only quantization: the kernel's arithmetic and greedy agreement with fp32."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from services.worker.engine.loader import LoadedModel, load_model
from services.worker.engine.quant import Int8Linear, quantize_per_channel
from tests.unit.engine.greedy import greedy_generate

AGREEMENT_PROMPTS = [
    "The history of the Roman Empire",
    "To make a cup of tea, first",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
]
AGREEMENT_TOKENS = 16
# Measured 0.95-0.97 (91-93 of 96 positions) on these prompts; wrong scales or a broken
# kernel give ~0.
AGREEMENT_FLOOR = 0.90


def test_per_channel_quantization_error_is_within_half_a_step() -> None:
    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(0)) * torch.linspace(
        0.01, 3.0, 48
    ).unsqueeze(1)
    q, scale = quantize_per_channel(weight)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert int(q.abs().max()) == 127
    assert torch.equal(scale.to(torch.bfloat16).float(), scale)
    error = (q.float() * scale[:, None] - weight).abs()
    # Half a step, plus what rounding the scale to bf16 can push the largest entry past 127.
    assert bool((error <= scale[:, None] * 0.51).all())


def test_int8_linear_matches_float_matmul_of_dequantized_weight() -> None:
    generator = torch.Generator().manual_seed(1)
    linear = nn.Linear(64, 96, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 64, generator=generator))
    quantized = Int8Linear(linear)
    x = torch.randn(5, 64, generator=generator)
    q, scale = quantize_per_channel(linear.weight.detach())
    expected = x @ (q.float() * scale[:, None]).T
    got = quantized(x)
    assert got.dtype == torch.float32 and got.shape == (5, 96)
    # Activations pass through bf16 (8 mantissa bits) for the fast kernel.
    torch.testing.assert_close(got, expected, atol=0.1, rtol=2e-2)
    quantized.packed_kernel = False  # the dequantizing path other devices take
    torch.testing.assert_close(quantized(x), expected, atol=1e-4, rtol=1e-5)


def test_int8_greedy_agreement_with_fp32(
    smollm2_fp32: LoadedModel, smollm2_gguf_path: Path
) -> None:
    int8 = load_model(str(smollm2_gguf_path), quantization="int8")
    assert int8.quantization == "int8"
    prompts = [smollm2_fp32.tokenizer.encode(text) for text in AGREEMENT_PROMPTS]
    reference = greedy_generate(smollm2_fp32, prompts, AGREEMENT_TOKENS)
    # Teacher-forced: int8 predicts each next token of the fp32 continuation.
    predicted = greedy_generate(int8, prompts, AGREEMENT_TOKENS, teacher_tokens=reference)
    ref_flat = [token for tokens in reference for token in tokens]
    pred_flat = [token for tokens in predicted for token in tokens]
    agreement = sum(a == b for a, b in zip(ref_flat, pred_flat, strict=True)) / len(ref_flat)
    print(f"int8 vs fp32 greedy top-1 agreement: {agreement:.3f} over {len(ref_flat)} positions")
    assert agreement >= AGREEMENT_FLOOR
