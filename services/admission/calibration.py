"""How far the workers' expected service times are from what requests then take.

The router's rates (kvmesh.service_rates) say how long a request's prompt and output take at
the workers' present load; a request admitted now runs beside the ones admitted after it, and
the rates lag the load they describe. The admission queue admits a waiter only while its
expected service still fits before its deadline, so an estimate that is short by a tenth
admits requests that end at their deadline with no answer, and the workers' time spent on
them is lost. Each finished request compares the time it held its slot with the service the
rates expect for its prompt and the tokens it produced; the admission scales the rates'
estimate by a high quantile of the recent ratios, so the requests it expects in time mostly
are. It only ever lengthens the estimate: a ratio under 1 mostly says that the rates, a line
fitted over every request, overstate short answers, and shortening every estimate by it
would admit the long ones that cannot finish.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class ServiceCalibration:
    """A multiplier for the expected service time, learned from finished requests."""

    quantile: float = 0.9
    """The share of recent requests whose service the scaled estimate covers."""
    window: int = 64
    """Finished requests the quantile is taken over, newest kept."""
    min_samples: int = 8
    """Before this many, estimates are used as the rates give them (factor 1)."""
    _ratios: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        if not 0 < self.quantile <= 1:
            raise ValueError("quantile must be in (0, 1]")
        if not 1 <= self.min_samples <= self.window:
            raise ValueError("need 1 <= min_samples <= window")
        self._ratios = deque(maxlen=self.window)

    @property
    def factor(self) -> float:
        """Actual over expected service time that `quantile` of recent requests stayed within,
        at least 1."""
        if len(self._ratios) < self.min_samples:
            return 1.0
        ordered = sorted(self._ratios)
        return max(1.0, ordered[math.ceil(self.quantile * len(ordered)) - 1])

    def observe(self, held_s: float, expected_s: float) -> None:
        """One finished request: the time it held its slot and the service time the rates
        expect for its prompt and output (both positive, else nothing is learned)."""
        if held_s > 0 and expected_s > 0:
            self._ratios.append(held_s / expected_s)

    def scaled(self, service_s: float | None) -> float | None:
        """The expected service time as requests have recently taken it (None stays None)."""
        return None if service_s is None else service_s * self.factor
