"""A clock the tests move by hand, for the code that takes one (`clock=`)."""

from __future__ import annotations


class FakeClock:
    """Calling it gives `now`; a test sets or advances `now` itself."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
