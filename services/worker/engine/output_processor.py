"""Per-request output processing: what each sampled token releases, and when a request stops.

The contract (protos/kvmesh/v1/common.proto, TokenChunk): `token_ids` and `text` describe the
same tokens. A stop token (EOS, a stop_token_id) and a stop string are in neither: the tokens
that carry only a stop string's text are left out with it, and a token whose text begins before
a stop string is kept with its text cut where the stop string starts. So tokens whose text could
still begin a stop string are held back together with their text until the next tokens show
whether the stop string completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.worker.engine.api import FinishReason, SamplingParams, TokenLogprob


class TextDecoder(Protocol):
    """Turns token ids into text deltas (IncrementalDetokenizer satisfies it)."""

    def push(self, token_ids: Sequence[int]) -> str: ...


@dataclass(slots=True)
class Emission:
    """What the caller gets after one token: released tokens, their text, maybe the end."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One per released token when the request asked for logprobs, else empty."""
    finish: FinishReason | None = None

    def then(self, later: Emission) -> Emission:
        """This emission followed by a later one (whose finish reason wins when set)."""
        return Emission(
            self.token_ids + later.token_ids,
            self.text + later.text,
            self.logprobs + later.logprobs,
            later.finish or self.finish,
        )


@dataclass(slots=True)
class _HeldToken:
    token_id: int
    logprob: TokenLogprob | None
    starts_at: int
    """Where the token's text starts within the held text."""


class OutputProcessor:
    """Decides, token by token, which tokens and text to release and whether to stop."""

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
        self._held_text = ""
        self._held: list[_HeldToken] = []

    def process(
        self,
        token_id: int,
        logprob: TokenLogprob | None,
        num_output_tokens: int,
        num_total_tokens: int,
    ) -> Emission:
        """Account for one sampled token (already counted in the two totals)."""
        if token_id in self._stop_ids:
            # What was held back is ordinary output; the stop token itself is in neither.
            return self.flush(FinishReason.STOP)
        self._held.append(_HeldToken(token_id, logprob, len(self._held_text)))
        self._held_text += self._decoder.push([token_id])
        stops = self._sampling.stop
        if not stops:
            emission = self.flush()
        else:
            keep = _longest_stop_prefix_suffix(self._held_text, stops)
            emission = self._release(len(self._held_text) - keep)
        if emission.finish is None and (
            num_output_tokens >= self._sampling.max_tokens
            or num_total_tokens >= self._context_length
        ):
            return emission.then(self.flush(FinishReason.LENGTH))
        return emission

    def flush(self, finish: FinishReason | None = None) -> Emission:
        """Release everything held back (the request ends for a reason other than a stop
        string, or nothing can begin one)."""
        emission = _emission(self._held, self._held_text, finish)
        self._held_text, self._held = "", []
        return emission

    def _release(self, cut: int) -> Emission:
        """Releases the held text before `cut` and the tokens whose text starts before it.

        A stop string in the held text moves the cut to where it starts and ends the request
        there: what follows it is dropped.
        """
        stop_at = _earliest_stop(self._held_text, self._sampling.stop)
        if stop_at is not None:
            cut = stop_at
        released = [token for token in self._held if token.starts_at < cut]
        finish = None if stop_at is None else FinishReason.STOP
        emission = _emission(released, self._held_text[:cut], finish)
        if stop_at is not None:
            self._held_text, self._held = "", []
        else:
            self._held_text = self._held_text[cut:]
            self._held = [
                _HeldToken(token.token_id, token.logprob, token.starts_at - cut)
                for token in self._held[len(released) :]
            ]
        return emission


def _emission(tokens: list[_HeldToken], text: str, finish: FinishReason | None) -> Emission:
    return Emission(
        [token.token_id for token in tokens],
        text,
        [token.logprob for token in tokens if token.logprob is not None],
        finish,
    )


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
