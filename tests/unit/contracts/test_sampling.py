"""The request rules every hop shares."""

from __future__ import annotations

from kvmesh.contracts.sampling import is_deterministic
from kvmesh.v1 import common_pb2


def test_deterministic_means_greedy_or_seeded() -> None:
    assert is_deterministic(common_pb2.SamplingParams())
    assert is_deterministic(common_pb2.SamplingParams(temperature=0.0))
    assert is_deterministic(common_pb2.SamplingParams(temperature=0.8, seed=1))
    assert not is_deterministic(common_pb2.SamplingParams(temperature=0.8))
