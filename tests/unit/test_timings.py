"""Timings in Finished: the time to the first token only when a token was produced."""

from __future__ import annotations

import time

from kvmesh.timings import request_timings
from services.admission.transcript import Transcript


def test_ttft_is_unset_without_a_token() -> None:
    arrived = time.monotonic() - 0.5
    timings = request_timings(arrived, None, queue_s=0.1, kv_transfer_ms=2.0)
    assert not timings.HasField("ttft_ms")
    assert timings.e2e_ms >= 500 and timings.queue_ms == 100.0 and timings.kv_transfer_ms == 2.0


def test_ttft_is_the_time_to_the_first_token() -> None:
    arrived = time.monotonic() - 0.5
    timings = request_timings(arrived, arrived + 0.2)
    assert timings.HasField("ttft_ms") and abs(timings.ttft_ms - 200.0) < 1e-6
    assert timings.e2e_ms >= 500


def test_a_gateway_transcript_without_tokens_reports_no_ttft() -> None:
    transcript = Transcript("r1", "tiny", prompt_tokens=4, arrived=time.monotonic())
    assert not transcript.timings(0.0).HasField("ttft_ms")
