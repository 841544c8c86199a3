"""Generated tokens per second: now (a trailing window) and the most a worker sustained.

The most sustained is the worker's measured capacity: WorkerStats.peak_tokens_per_second, which
the router prices a tier by (ListModels) and sizes its pools against. One meter serves both
engine backends.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from services.worker.engine.api import THROUGHPUT_WINDOW_S


class ThroughputMeter:
    """Counts generated tokens; safe to read from another thread than the one recording."""

    def __init__(
        self,
        window_s: float = THROUGHPUT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window_s = window_s
        self._clock = clock
        self._recent: deque[tuple[float, int]] = deque()
        self._in_window = 0
        self._peak = 0.0
        self._lock = threading.Lock()

    def record(self, num_tokens: int) -> None:
        """`num_tokens` tokens were generated just now."""
        with self._lock:
            now = self._clock()
            self._recent.append((now, num_tokens))
            self._in_window += num_tokens
            self._expire(now)
            # The average over a trailing window never exceeds what was really sustained.
            self._peak = max(self._peak, self._in_window / self._window_s)

    def tokens_per_second(self) -> float:
        """The average over the trailing window."""
        with self._lock:
            self._expire(self._clock())
            return self._in_window / self._window_s

    def peak_tokens_per_second(self) -> float:
        """The highest trailing-window average so far (0 before any token)."""
        with self._lock:
            return self._peak

    def _expire(self, now: float) -> None:
        while self._recent and self._recent[0][0] <= now - self._window_s:
            self._in_window -= self._recent.popleft()[1]
