"""The shedding rule: refuse at once what cannot finish before its deadline.

A request arriving now would wait `wait_s` for a slot (the admission queue's estimate) and
then take `service_s` on the workers (their measured prefill and decode rates for its prompt
and max_tokens, kvmesh.service_rates). When the two together outlast the time it has left it
is refused now, with a retry-after a client can honour, rather than admitted to fail at its
deadline after holding a slot that a request which could finish needed.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_RETRY_S = 0.05
"""Shortest retry-after given (a client retrying sooner would only be refused again)."""


@dataclass(slots=True, frozen=True)
class Refusal:
    """Why a request is refused, and when to come back."""

    reason: str
    """A metrics label: "deadline" (the wait alone is too long) or "service_time"."""
    message: str
    retry_after_s: float


def judge(time_left_s: float | None, wait_s: float, service_s: float | None) -> Refusal | None:
    """The refusal of a request with `time_left_s` to its deadline (None: no deadline), or
    None to admit it. `service_s` is None while the workers' rates are unknown (then only
    the wait counts, as before they were measured)."""
    if time_left_s is None:
        return None
    left = max(time_left_s, 0.0)
    needed = wait_s + (service_s or 0.0)
    # When to come back: once the queue ahead has drained by what it is over (the same
    # request, deadline and rates would fit then), never sooner than MIN_RETRY_S.
    retry_after_s = max(needed - left, MIN_RETRY_S)
    if wait_s > left:
        return Refusal(
            "deadline",
            f"expected wait in the admission queue ({wait_s:.3f}s) exceeds the request's "
            f"deadline ({left:.3f}s left)",
            retry_after_s,
        )
    if service_s is not None and needed > left:
        return Refusal(
            "service_time",
            f"expected wait ({wait_s:.3f}s) plus the workers' expected time for this prompt "
            f"and max_tokens ({service_s:.3f}s) exceeds the request's deadline "
            f"({left:.3f}s left)",
            retry_after_s,
        )
    return None
