"""How far the admission's estimates are from what requests then take.

Service: the router's rates (kvmesh.service_rates) say how long a request's prompt and output
take at the workers' present load; a request admitted now runs beside the ones admitted after
it, and the rates lag the load they describe. The admission queue admits a waiter only while
its expected service still fits before its deadline, so an estimate that is short by a tenth
admits requests that end at their deadline with no answer, and the workers' time spent on them
is lost. Each finished request compares the time it held its slot with the service the rates
expect for its prompt and the tokens it produced; the admission scales the rates' estimate by a
high quantile of the recent ratios (the 75th percentile), so the requests it expects in time
mostly are. It only ever lengthens the estimate: a ratio under 1 mostly says that the rates, a
line fitted over every request, overstate short answers, and shortening every estimate by it
would admit the long ones that cannot finish.

Wait: the queue's expected wait assumes slots free up at the average pace, but the workers
batch requests and those admitted together end together, and the rates it sheds by swing
with each wave of prompts, so waits run over their estimate by seconds at a time. A request
whose time to spare is less than that is a coin toss: queued, it mostly waits past the point
where it could still finish, and ends with nothing and no word on when to come back. Each
queued request's wait (or the part it waited before it gave up or was found too late) is
compared with the estimate it was admitted on, and the admission adds a high quantile of the
recent overruns to the estimate it sheds by. It never shortens it: waits that came sooner
than expected are no reason to promise a shorter one.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class _RecentQuantile:
    """A high quantile of the newest samples of some error."""

    quantile: float = 0.9
    """The share of recent samples the quantile covers."""
    window: int = 64
    """Samples the quantile is taken over, newest kept."""
    min_samples: int = 8
    """Before this many, no correction is made."""
    _samples: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        if not 0 < self.quantile <= 1:
            raise ValueError("quantile must be in (0, 1]")
        if not 1 <= self.min_samples <= self.window:
            raise ValueError("need 1 <= min_samples <= window")
        self._samples = deque(maxlen=self.window)

    def _at_least(self, floor: float) -> float:
        """The quantile of the samples kept, never under `floor` (`floor` before
        `min_samples`)."""
        if len(self._samples) < self.min_samples:
            return floor
        ordered = sorted(self._samples)
        return max(floor, ordered[math.ceil(self.quantile * len(ordered)) - 1])


@dataclass(slots=True)
class ServiceCalibration(_RecentQuantile):
    """A multiplier for the expected service time, learned from finished requests."""

    quantile: float = 0.75
    """The share of recent requests the scaled estimate covers. A request is shed when its
    estimate does not fit its deadline, so the quantile is how sure the admission must be that
    it would finish before it lets it queue. At the 90th percentile, at 1x load (7.9-9.0
    answers/s of capacity on 2 cores of an AMD EPYC Zen 4), the admission refused up to 10% of
    interactive answers it expected to take 12-14 s, which took under 10 s (the fixed limit
    refused none and missed no deadline); at the 75th, none in two runs, and 3x load kept
    0.86-0.89x of capacity in time (0.78-0.87x at the 90th)."""

    @property
    def factor(self) -> float:
        """Actual over expected service time that `quantile` of recent requests stayed within,
        at least 1."""
        return self._at_least(1.0)

    def observe(self, held_s: float, expected_s: float) -> None:
        """One finished request: the time it held its slot and the service time the rates
        expect for its prompt and output (both positive, else nothing is learned)."""
        if held_s > 0 and expected_s > 0:
            self._samples.append(held_s / expected_s)

    def scaled(self, service_s: float | None) -> float | None:
        """The expected service time as requests have recently taken it (None stays None)."""
        return None if service_s is None else service_s * self.factor


@dataclass(slots=True)
class WaitCalibration(_RecentQuantile):
    """A margin for the expected wait in the queue, learned from queued requests."""

    @property
    def margin_s(self) -> float:
        """Seconds by which `quantile` of recent waits stayed within their estimate plus it,
        at least 0."""
        return self._at_least(0.0)

    def observe(self, waited_s: float, expected_s: float) -> None:
        """One queued request: how long it waited for its slot (or before it left the queue
        unserved) and the wait it was admitted on."""
        self._samples.append(waited_s - expected_s)
