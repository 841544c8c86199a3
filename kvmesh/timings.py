"""The Timings every hop reports in its Finished event, built one way.

The time to the first token is left unset when no token was produced: a zero would read as an
instant answer, and the time to the end would read as a slow one.
"""

from __future__ import annotations

import time

from kvmesh.v1 import common_pb2


def request_timings(
    arrived: float,
    first_token_at: float | None,
    *,
    queue_s: float = 0.0,
    kv_transfer_ms: float = 0.0,
) -> common_pb2.Timings:
    """Timings of a request that arrived at `arrived` and ends now (time.monotonic() values)."""
    timings = common_pb2.Timings(
        queue_ms=queue_s * 1000.0,
        e2e_ms=(time.monotonic() - arrived) * 1000.0,
        kv_transfer_ms=kv_transfer_ms,
    )
    if first_token_at is not None:
        timings.ttft_ms = (first_token_at - arrived) * 1000.0
    return timings
