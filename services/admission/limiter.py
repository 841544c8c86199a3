"""How many requests the gateway lets run toward the router at once.

A fixed limit (`--no-adaptive-admission`, the old behaviour) or an adaptive one that follows
the latency the requests measure, in the manner of gradient concurrency limits (Netflix's
concurrency-limits, Gradient2 and Vegas): the mean latency of a short window of finished
requests against a baseline, the lowest such window of a longer stretch (re-measured as the
stretch slides on), says whether the requests in flight are queueing behind each other:

    ratio = window / baseline

Within `tolerance` nothing queues: the limit grows by its square root (while at least half of
it is in use). Over it the limit shrinks by the gradient `tolerance / ratio`, never by more
than `max_decrease` at once, and never below the workers' batch.

The latency of a request is its time from admission to its end per output token it produced,
so requests of different lengths compare.

The workers batch the requests they run, one step serves all of them, so their latency per
token grows with the batch even where nothing queues, and below the batch (max_num_seqs, 64
per worker by default) it runs part-empty and throughput falls with it. Latency alone
therefore never takes the limit below `batch`; above it the extra requests wait in the engine
and their time to first token shows as the queueing the gradient takes back. What can take
the limit below the batch is a deadline missed by a request that its admission expected to
finish in time (its expected wait and service fitted): then the batch is larger than the
deadlines allow (on a compute-bound worker each request's steps slow down as the batch
grows), and the limit shrinks by the share of the window that ran late, down to
`min_limit`. A missed deadline the admission did not promise (a request started on a free
slot though it could not finish) is no such sign, nor is one the request would have met
had it not waited in the queue (its pace while it ran, kept up to its max_tokens, fitted
its whole time: the queue was too long, which shedding answers; admission_queue.py), nor
are the few promised ones that the estimate leaves out by design (it covers a quantile
of recent requests, calibration.py): a window shrinks the limit only when more than
`late_tolerance` of it ran late. Since latency is no reason to be below the batch, a
window below it whose lateness is within that tolerance grows the limit back toward the
batch whatever its latency; else one late burst (a whole cohort admitted together and
ending together) would leave the batch part-empty for good, its lower throughput making
the waits it set out to shorten longer.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol


class ConcurrencyLimit(Protocol):
    """A bound on requests in flight that may learn from each finished request."""

    @property
    def limit(self) -> int:
        """Requests that may run at once now."""
        ...

    def observe(self, latency_s: float, in_flight: int, late: bool = False) -> None:
        """One finished request: its latency per output token since admission, how many
        were in flight when it ended, and whether it missed the deadline its admission
        expected it to meet, and would have without its wait in the queue."""
        ...


@dataclass(slots=True)
class FixedLimit:
    """The same bound whatever the latency."""

    value: int

    @property
    def limit(self) -> int:
        return self.value

    def observe(self, latency_s: float, in_flight: int, late: bool = False) -> None:
        return None


@dataclass(slots=True, frozen=True)
class GradientSettings:
    """Bounds and gains of the adaptive limit."""

    batch: int = 64
    """The limit before anything was measured, and the lowest latency takes it to: the
    workers' batch (one worker's max_num_seqs in `kvmesh up`'s default stack)."""
    min_limit: int = 4
    """The floor, reached only by late requests."""
    max_limit: int = 256
    """The limit never goes above this (`--max-in-flight`)."""
    tolerance: float = 1.25
    """A window this many times the baseline still counts as nothing queued."""
    window: int = 16
    """Finished requests averaged into one window; the limit moves once per window."""
    baseline_windows: int = 32
    """The baseline is the lowest of the last this many windows closed with the limit at or
    below the batch (or lower than it), so a lighter time long past, a model change or a
    quieter machine is forgotten."""
    late_tolerance: float = 0.1
    """Share of a window's requests that may miss the deadline their admission expected them
    to meet without shrinking the limit: the expected service covers the 75th percentile of
    recent requests (calibration.py), so a quarter run over it by design and some of those
    that were admitted with little time to spare miss; more than a tenth says the batch is too
    slow for the deadlines."""
    max_decrease: float = 0.5
    """The most one window may take off: the limit at most halves at once."""
    smoothing: float = 0.5
    """Share of each step taken at once (1: all of it)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.batch <= self.max_limit:
            raise ValueError("need 1 <= min_limit <= batch <= max_limit")
        if self.tolerance < 1:
            raise ValueError("tolerance must be at least 1")
        if self.window < 1 or self.baseline_windows < 1:
            raise ValueError("window and baseline_windows must be at least 1")
        if not 0 <= self.late_tolerance < 1:
            raise ValueError("late_tolerance must be in [0, 1)")
        if not 0 < self.max_decrease <= 1:
            raise ValueError("max_decrease must be in (0, 1]")
        if not 0 < self.smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")


@dataclass(slots=True)
class GradientLimit:
    """The adaptive limit; see the module docstring."""

    settings: GradientSettings = field(default_factory=GradientSettings)
    estimate: float = field(init=False)
    windows: deque[float] = field(init=False)
    """Mean latency per output token of the last baseline_windows windows, newest last."""
    _samples: list[float] = field(default_factory=list, init=False)
    _busiest: int = field(default=0, init=False)
    """Most requests in flight seen in the current window."""
    _late: int = field(default=0, init=False)
    """Requests of the current window that missed the deadline they were expected to meet."""

    def __post_init__(self) -> None:
        self.estimate = float(self.settings.batch)
        self.windows = deque(maxlen=self.settings.baseline_windows)

    @property
    def limit(self) -> int:
        return int(self.estimate)

    @property
    def baseline_s(self) -> float | None:
        """The lowest window's latency per token (None before a window closed)."""
        return min(self.windows) if self.windows else None

    def observe(self, latency_s: float, in_flight: int, late: bool = False) -> None:
        if latency_s <= 0:
            return
        self._samples.append(latency_s)
        self._busiest = max(self._busiest, in_flight)
        self._late += late
        if len(self._samples) < self.settings.window:
            return
        mean = sum(self._samples) / len(self._samples)
        late_share = self._late / len(self._samples)
        busiest = self._busiest
        self._samples.clear()
        self._busiest = self._late = 0
        # Above the batch only a lower window joins the baseline: the windows that are there
        # because the limit grew must not push out the ones that show what it grew from, or
        # the baseline would creep up with the queue it should measure.
        if not self.windows or self.limit <= self.settings.batch or mean < min(self.windows):
            self.windows.append(mean)
        self._update(mean / min(self.windows), busiest, late_share)

    def _update(self, ratio: float, busiest: int, late_share: float) -> None:
        """Moves the estimate for one window of `ratio` times the baseline in which
        `late_share` of the requests missed the deadline they were expected to meet."""
        s = self.settings
        limit = self.estimate
        if late_share > s.late_tolerance:
            target = limit * max(s.max_decrease, 1 - late_share)
        elif limit < s.batch:
            # Below the batch only lateness holds the limit: with none to speak of it returns.
            target = min(limit + math.sqrt(limit), float(s.batch))
        elif ratio > s.tolerance:
            # What batching costs is no reason to leave the batch part-empty.
            floor = min(limit, float(s.batch))
            target = max(floor, limit * max(s.max_decrease, s.tolerance / ratio))
        elif busiest * 2 < limit:
            return  # too little load to say the limit could be higher
        else:
            target = limit + math.sqrt(limit)
        bounded = max(float(s.min_limit), min(float(s.max_limit), target))
        self.estimate = (1 - s.smoothing) * limit + s.smoothing * bounded
