"""Token sampling over a batch of logits rows, each with its own SamplingParams.

Greedy rows are one argmax call; random rows get temperature, top-k and top-p applied as
batched tensor ops, then each row draws alone. A seeded request's draw for output token i
comes from a generator seeded with (seed, i), so it samples the same tokens whatever shares its
batch, after a preemption (recompute), and after its KV moved to another engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.worker.engine.api import SamplingParams, TokenLogprob


@dataclass(slots=True)
class SampleRow:
    """One logits row: its sampling parameters and which output token it samples."""

    params: SamplingParams
    output_index: int


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: None unless that row asked for logprobs.
    logprobs: list[TokenLogprob | None]


def needs_host(rows: Sequence[SampleRow]) -> bool:
    """Whether sampling these rows takes the logits on the CPU, where the sampler's generators
    and index tensors are: every row but a greedy one without logprobs (a bare argmax)."""
    return not all(row.params.greedy and row.params.logprobs is None for row in rows)


def draw_seed(seed: int, output_index: int) -> int:
    """The generator seed for one draw of a seeded request (a 64-bit mix of both)."""
    data = seed.to_bytes(8, "little") + output_index.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class Sampler:
    def __init__(self) -> None:
        self._unseeded = torch.Generator()
        self._unseeded.seed()  # fresh entropy per engine
        self._seeded = torch.Generator()

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SamplerOutput:
        """Pick one token per row of fp32 logits [len(rows), vocab]."""
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if len(greedy) == len(rows):
            token_ids: list[int] = logits.argmax(dim=-1).tolist()
        else:
            token_ids = [0] * len(rows)
            if greedy:
                for i, token in zip(greedy, logits[greedy].argmax(dim=-1).tolist(), strict=True):
                    token_ids[i] = token
            randoms = [i for i, row in enumerate(rows) if not row.params.greedy]
            drawn = self._sample_random(logits[randoms], [rows[i] for i in randoms])
            for i, token in zip(randoms, drawn, strict=True):
                token_ids[i] = token
        return SamplerOutput(token_ids, _logprobs(logits, rows, token_ids))

    def _sample_random(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
        temperature = torch.tensor([row.params.temperature for row in rows], dtype=logits.dtype)
        scaled = logits / temperature.unsqueeze(1)
        scaled = _apply_top_k(scaled, [row.params.top_k for row in rows])
        scaled = _apply_top_p(scaled, [row.params.top_p for row in rows])
        probs = torch.softmax(scaled, dim=-1)
        return [
            int(torch.multinomial(probs[i], 1, generator=self._generator(row)))
            for i, row in enumerate(rows)
        ]

    def _generator(self, row: SampleRow) -> torch.Generator:
        if row.params.seed is None:
            return self._unseeded
        self._seeded.manual_seed(draw_seed(row.params.seed, row.output_index))
        return self._seeded


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else 0 for k in top_ks]
    if not any(ks):
        return logits
    k_max = max(ks)
    top_values = logits.topk(k_max, dim=-1).values
    k_index = torch.tensor([max(k, 1) - 1 for k in ks]).unsqueeze(1)
    threshold = top_values.gather(1, k_index)
    # Rows without top-k keep everything.
    threshold[torch.tensor([k == 0 for k in ks])] = -torch.inf
    return logits.masked_fill(logits < threshold, -torch.inf)


def _apply_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in top_ps):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Probability mass strictly before each token; the first token is always kept.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    top_p = torch.tensor(top_ps, dtype=logits.dtype).unsqueeze(1)
    drop_sorted = (mass_before >= top_p) & (top_p < 1.0)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, -torch.inf)


def _logprobs(
    logits: torch.Tensor, rows: Sequence[SampleRow], token_ids: list[int]
) -> list[TokenLogprob | None]:
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(rows)
    if not wanted:
        return result
    # Logprobs of the model's own distribution (before temperature and filtering).
    log_probs = torch.log_softmax(logits[wanted], dim=-1)
    n_max = max(rows[i].params.logprobs or 0 for i in wanted)
    top = log_probs.topk(n_max, dim=-1) if n_max else None
    chosen = log_probs.gather(1, torch.tensor([[token_ids[i]] for i in wanted])).squeeze(1)
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs or 0
        alternatives: list[tuple[int, float]] = []
        if top is not None and n:
            alternatives = list(
                zip(top.indices[j, :n].tolist(), top.values[j, :n].tolist(), strict=True)
            )
        result[i] = TokenLogprob(token_ids[i], float(chosen[j]), alternatives)
    return result
