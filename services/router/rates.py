"""What the router measures of each worker's speed: prefill time by prompt length, and the
time between two tokens of one sequence (the worker's step time at its present load).

The samples are the router's own calls: a Prefill call (or a colocated Generate up to its
first token) against the prompt tokens the worker had to compute, and the gap between two
chunks of a stream the worker was decoding. Older samples fade, so the figures follow the
load. ListModels reports each tier's average (kvmesh.service_rates.ServiceRates); the gateway
sheds by it, and a call that goes quiet for many step times has a stalled worker.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvmesh.service_rates import ServiceRates

PREFILL_DECAY = 0.9
"""Weight an older prefill sample keeps at each new one (about the last ten count)."""
DECODE_HORIZON_S = 5.0
"""Seconds over which the gaps between tokens are averaged, each token alike, older ones
fading as e^(-age / DECODE_HORIZON_S): about the time a request decodes, which is what the
gateway's estimate of its service time stands for. A colocated worker's gaps swing with each
wave of prompts it prefills between decode steps; averaged over a count of gaps instead (the
newest weighing 0.02), the figure followed every wave (with 60 streams decoding, 50 gaps are a
fifth of a second), and the gateway, which reads the rates every 10 s, shed by a peak of half
a second: at 1x load it refused interactive answers of 32 tokens that it expected to take
23 s, and that took about 7 s."""


@dataclass(slots=True)
class PrefillFit:
    """Exponentially weighted least squares of seconds = base + per_token * tokens."""

    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        d = PREFILL_DECAY
        self.weight = d * self.weight + 1.0
        self.sum_x = d * self.sum_x + tokens
        self.sum_y = d * self.sum_y + seconds
        self.sum_xx = d * self.sum_xx + tokens * tokens
        self.sum_xy = d * self.sum_xy + tokens * seconds

    def line(self) -> tuple[float, float]:
        """(base, per_token), both >= 0. Prompts of one length cannot tell the two apart:
        then (and whenever the fit says base < 0 or per_token < 0) the time is taken as
        proportional to the tokens, which is exact at the lengths seen."""
        spread = self.weight * self.sum_xx - self.sum_x * self.sum_x
        if spread > 1e-9 * max(self.sum_xx * self.weight, 1.0):
            per_token = (self.weight * self.sum_xy - self.sum_x * self.sum_y) / spread
            base = (self.sum_y - per_token * self.sum_x) / self.weight
            if per_token >= 0 and base >= 0:
                return base, per_token
        if self.sum_x > 0:
            return 0.0, self.sum_y / self.sum_x
        return self.sum_y / max(self.weight, 1e-9), 0.0


@dataclass(slots=True)
class WorkerRates:
    """One worker's measured speed."""

    prefill: PrefillFit | None = None
    gap_s: float = 0.0
    """Seconds between tokens of the sequences it decodes, summed with fading weights."""
    gap_tokens: float = 0.0
    """The tokens that came after those gaps, summed with the same weights."""
    gap_at: float | None = None
    """When the sums last took a gap (None: never)."""

    @property
    def step_s(self) -> float | None:
        """The average time between two tokens of a sequence over about the last
        DECODE_HORIZON_S (None before any gap)."""
        return self.gap_s / self.gap_tokens if self.gap_tokens > 0 else None


class RateBook:
    """Measured speeds by worker address."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._workers: dict[str, WorkerRates] = {}
        self._clock = clock

    def _of(self, address: str) -> WorkerRates:
        rates = self._workers.get(address)
        if rates is None:
            rates = self._workers[address] = WorkerRates()
        return rates

    def observe_prefill(self, address: str, tokens: int, seconds: float) -> None:
        """A first token that took `seconds` for `tokens` uncached prompt tokens."""
        rates = self._of(address)
        if rates.prefill is None:
            rates.prefill = PrefillFit()
        rates.prefill.add(max(tokens, 1), max(seconds, 0.0))

    def observe_gap(self, address: str, tokens: int, seconds: float) -> None:
        """`tokens` decoded tokens that arrived `seconds` after the previous ones."""
        if tokens < 1:
            return
        rates = self._of(address)
        now = self._clock()
        if rates.gap_at is not None:
            fade = math.exp(-max(now - rates.gap_at, 0.0) / DECODE_HORIZON_S)
            rates.gap_s *= fade
            rates.gap_tokens *= fade
        rates.gap_s += max(seconds, 0.0)
        rates.gap_tokens += tokens
        rates.gap_at = now

    def prefill_s(self, address: str, tokens: int) -> float | None:
        """The worker's measured time for a prefill of `tokens` uncached tokens; None before
        any."""
        fit = self._of_known(address).prefill
        if fit is None:
            return None
        base, per_token = fit.line()
        return base + per_token * tokens

    def step_s(self, address: str) -> float | None:
        """The worker's measured time between two tokens; None before any."""
        rates = self._workers.get(address)
        return rates.step_s if rates is not None else None

    def tier_rates(
        self, prefill_workers: Iterable[str], decode_workers: Iterable[str]
    ) -> ServiceRates | None:
        """The average over the given workers of what was measured; None until both a
        prefill and a gap between tokens were."""
        lines = [
            fit.line()
            for address in prefill_workers
            if (fit := self._of_known(address).prefill) is not None
        ]
        steps = [step for address in decode_workers if (step := self._of_known(address).step_s)]
        if not lines or not steps:
            return None
        return ServiceRates(
            prefill_base_s=sum(base for base, _ in lines) / len(lines),
            prefill_s_per_token=sum(per_token for _, per_token in lines) / len(lines),
            decode_s_per_token=sum(steps) / len(steps),
        )

    def _of_known(self, address: str) -> WorkerRates:
        return self._workers.get(address) or WorkerRates()
