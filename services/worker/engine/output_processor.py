"""Per-request output processing: text deltas and stop conditions after each sampled token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from services.worker.engine.api import FinishReason, SamplingParams


class TextDecoder(Protocol):
    """Turns token ids into text deltas (IncrementalDetokenizer satisfies it)."""

    def push(self, token_ids: Sequence[int]) -> str: ...


class OutputProcessor:
    """Decides, token by token, what text to emit and whether the request is finished.

    Stop strings are never emitted. Text that could be the start of a stop string is held
    back until the next tokens show whether the stop string completes, so a stop string split
    across tokens is still caught before any of it reaches the caller.
    """

    def __init__(
        self,
        sampling: SamplingParams,
        decoder: TextDecoder,
        eos_token_ids: frozenset[int],
        context_length: int,
    ) -> None:
        self._sampling = sampling
        self._decoder = decoder
        self._stop_ids = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.ignore_eos else eos_token_ids
        )
        self._context_length = context_length
        self._held = ""

    def process(
        self, token_id: int, num_output_tokens: int, num_total_tokens: int
    ) -> tuple[str, FinishReason | None]:
        """Account for one sampled token (already counted in the two totals)."""
        if token_id in self._stop_ids:
            # The stop token itself has no text; what was held back is ordinary text.
            return self.flush(), FinishReason.STOP
        text = self._held + self._decoder.push([token_id])
        self._held = ""
        if self._sampling.stop:
            stop_at = _earliest_stop(text, self._sampling.stop)
            if stop_at is not None:
                return text[:stop_at], FinishReason.STOP
            keep = _longest_stop_prefix_suffix(text, self._sampling.stop)
            text, self._held = text[: len(text) - keep], text[len(text) - keep :]
        if (
            num_output_tokens >= self._sampling.max_tokens
            or num_total_tokens >= self._context_length
        ):
            return text + self.flush(), FinishReason.LENGTH
        return text, None

    def flush(self) -> str:
        """Release held-back text (the request ends for a reason other than a stop string)."""
        held, self._held = self._held, ""
        return held


def _earliest_stop(text: str, stops: Sequence[str]) -> int | None:
    positions = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(positions) if positions else None


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    longest = min(len(text), max(len(s) for s in stops) - 1)
    for length in range(longest, 0, -1):
        tail = text[-length:]
        if any(s.startswith(tail) for s in stops):
            return length
    return 0
