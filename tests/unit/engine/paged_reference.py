"""Attention over a paged KV cache computed the plain way, token by token, for the kernels'
tests."""

from __future__ import annotations

import math

import torch

BLOCK_SIZE = 16


def reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: list[list[int]],
    contexts: list[int],
    window: int = 0,
    probabilities: torch.dtype | None = None,
) -> torch.Tensor:
    """Each row's context (its last `window` tokens when window > 0) gathered token by token,
    softmax(q k^T / sqrt(d)) v per head; with `probabilities`, the softmax's numerators
    rounded to that dtype before they weigh the values (its sum unrounded)."""
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // keys.shape[2]
    rows = []
    for row, (table, context) in enumerate(zip(tables, contexts, strict=True)):
        first = max(0, context - window) if window else 0
        slots = [
            table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(first, context)
        ]
        k = keys.reshape(-1, *keys.shape[2:])[slots]  # [context, kv_heads, dim]
        v = values.reshape(-1, *values.shape[2:])[slots]
        out = []
        for h in range(heads):
            scores = k[:, h // group] @ q[row, h] / math.sqrt(head_dim)
            exps = torch.exp(scores.double() - scores.max())
            numerators = exps if probabilities is None else exps.to(probabilities).double()
            weights = numerators / exps.sum()
            out.append(weights.float() @ v[:, h // group])
        rows.append(torch.stack(out))
    return torch.stack(rows)
