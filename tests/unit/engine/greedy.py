"""Greedy references: a plain greedy loop over ModelRunner (all prompts prefilled in one
batch, then decoded together one token per step, no scheduler involved) and transformers'
own greedy generate."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from services.worker.engine.loader import LoadedModel
from services.worker.engine.model_runner import BatchEntry, ModelRunner


def greedy_generate(
    loaded: LoadedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int = 16,
    teacher_tokens: list[list[int]] | None = None,
) -> list[list[int]]:
    """The argmax token of every step. With teacher_tokens, those are fed back instead of the
    model's own picks (to compare two models position by position on the same text)."""
    fed = teacher_tokens
    blocks_each = math.ceil((max(map(len, prompts)) + max_new_tokens) / block_size)
    runner = ModelRunner(loaded, num_blocks=blocks_each * len(prompts), block_size=block_size)
    # Sequence i owns every len(prompts)-th block, so tables interleave in the pool.
    tables = [list(range(i, blocks_each * len(prompts), len(prompts))) for i in range(len(prompts))]
    logits = runner.forward(
        [BatchEntry(prompt, 0, table) for prompt, table in zip(prompts, tables, strict=True)]
    )
    outputs = [[int(token)] for token in logits.argmax(dim=-1)]
    for step in range(1, max_new_tokens):
        previous = [out[step - 1] for out in (fed or outputs)]
        logits = runner.forward(
            [
                BatchEntry([token], len(prompt) + step - 1, table)
                for prompt, token, table in zip(prompts, previous, tables, strict=True)
            ]
        )
        for out, token in zip(outputs, logits.argmax(dim=-1), strict=True):
            out.append(int(token))
    return outputs


def transformers_greedy(
    folder: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[list[int]]:
    """transformers' greedy generate on the checkpoint in `folder` (whatever its family), one
    prompt at a time, EOS disabled (like ignore_eos)."""
    model = transformers_model(folder, device, dtype)
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            # An explicit mask: otherwise token 0 (the pad id) would be masked out.
            mask = torch.ones_like(ids)
            generated = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


def transformers_model(folder: Path, device: str, dtype: torch.dtype) -> Any:
    """transformers' model of the checkpoint in `folder`, in `dtype` on `device`, for inference."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    torch.nn.Module.to(model, device)
    return model
