"""How many requests the gateway lets run toward the router at once.

A fixed limit (`--admission fixed`, the old behaviour) or an adaptive one that follows the
latency the requests measure, in the manner of TCP Vegas (as Netflix's concurrency-limits
applies it to services): the latency of a request with nothing queued ahead of it anywhere
(the lowest seen, re-measured now and then) against the latency now says how many of the
requests in flight are queueing rather than being served:

    queued = limit * (1 - no_load / now)

Few queued: the workers have room, the limit grows; many: it shrinks; a request that missed
its deadline or failed downstream shrinks it too. The latency of a request is its time from
admission to its end per output token, so requests of different lengths compare; its
no-load value is the workers' own decode step (plus the prompt's share), and the limit settles
where adding requests to the workers' batch stops paying for itself in their step time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol


class ConcurrencyLimit(Protocol):
    """A bound on requests in flight that may learn from each finished request."""

    @property
    def limit(self) -> int:
        """Requests that may run at once now."""
        ...

    def observe(self, latency_s: float, in_flight: int, dropped: bool) -> None:
        """One finished request: its latency per output token since admission, how many
        were in flight when it ended, and whether it failed for load (a missed deadline)."""
        ...


@dataclass(slots=True)
class FixedLimit:
    """The same bound whatever the latency."""

    value: int

    @property
    def limit(self) -> int:
        return self.value

    def observe(self, latency_s: float, in_flight: int, dropped: bool) -> None:
        return None


@dataclass(slots=True, frozen=True)
class VegasSettings:
    """Bounds and gains of the adaptive limit."""

    initial: int = 8
    """The limit before anything was measured."""
    min_limit: int = 1
    """The limit never goes below this."""
    max_limit: int = 64
    """... nor above this (`--max-in-flight`)."""
    alpha: float = 3.0
    """Queued requests (times log10 of the limit) under which the limit grows."""
    beta: float = 6.0
    """Queued requests (times log10 of the limit) over which it shrinks."""
    smoothing: float = 1.0
    """Share of each step taken at once (1: all of it)."""
    probe_every: int = 30
    """The no-load latency is measured again after this many limits' worth of requests (the
    lowest latency seen might come from a lighter time, a model change, or a quieter machine)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.initial <= self.max_limit:
            raise ValueError("need 1 <= min_limit <= initial <= max_limit")
        if not 0 < self.alpha < self.beta:
            raise ValueError("need 0 < alpha < beta")
        if not 0 < self.smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")


@dataclass(slots=True)
class VegasLimit:
    """The adaptive limit; see the module docstring."""

    settings: VegasSettings = field(default_factory=VegasSettings)
    estimate: float = field(init=False)
    no_load_s: float | None = field(default=None, init=False)
    """Lowest latency per output token seen since the last probe."""
    _since_probe: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.estimate = float(self.settings.initial)

    @property
    def limit(self) -> int:
        return max(self.settings.min_limit, int(self.estimate))

    def observe(self, latency_s: float, in_flight: int, dropped: bool) -> None:
        if latency_s <= 0:
            return
        self._since_probe += 1
        if self._since_probe > self.settings.probe_every * self.estimate:
            # Forget the old no-load figure: the lowest latency from here on replaces it.
            self._since_probe = 0
            self.no_load_s = latency_s
            return
        if self.no_load_s is None or latency_s < self.no_load_s:
            self.no_load_s = latency_s
            return
        target = self._target(latency_s, in_flight, dropped)
        if target is None:
            return
        s = self.settings
        bounded = max(float(s.min_limit), min(float(s.max_limit), target))
        self.estimate = (1 - s.smoothing) * self.estimate + s.smoothing * bounded

    def _target(self, latency_s: float, in_flight: int, dropped: bool) -> float | None:
        """The next limit, or None to keep it."""
        assert self.no_load_s is not None
        limit = self.estimate
        step = max(1.0, math.log10(limit))
        if dropped:
            return limit - step
        if in_flight * 2 < limit:
            return None  # too little load to say anything about the limit
        queued = limit * (1 - self.no_load_s / latency_s)
        if queued <= step:
            return limit + self.settings.beta * step
        if queued < self.settings.alpha * step:
            return limit + step
        if queued > self.settings.beta * step:
            return limit - step
        return None
