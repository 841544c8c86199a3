"""Pool membership, health and load bookkeeping."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidArgument, NotFound
from kvmesh.v1 import worker_pb2
from services.router.pools import Role
from tests.unit.router.factories import healthy, registry, stats, tier


def test_workers_join_rotation_after_their_first_check_and_leave_on_failure() -> None:
    pools = registry(tier("t", prefill=("h:1",), decode=("h:2",)))
    assert not pools.serves("t")
    healthy(pools, "h:1")
    assert not pools.can_split("t")
    healthy(pools, "h:2")
    assert pools.can_split("t") and pools.serves("t")
    pools.record_check("h:2", None, "UNAVAILABLE: connection refused")
    assert not pools.serves("t")
    (decode,) = pools.workers("t", Role.DECODE)
    assert decode.last_error.startswith("UNAVAILABLE") and decode.stats is not None
    healthy(pools, "h:2")
    assert pools.serves("t") and decode.last_error == ""


def test_draining_worker_leaves_rotation() -> None:
    pools = registry(tier("t", colocated=("h:1",)))
    draining = stats()
    draining.draining = True
    pools.record_check("h:1", draining)
    assert not pools.serves("t")


def test_load_is_the_larger_of_reported_and_inflight() -> None:
    pools = registry(tier("t", colocated=("h:1",)))
    (worker,) = healthy(pools, "h:1", running=2, waiting=1)
    assert worker.load == 3
    worker.inflight = 5
    assert worker.load == 5
    assert worker.cached_hashes == frozenset()


def test_add_and_remove() -> None:
    pools = registry(tier("t", colocated=("h:1",)))
    pools.add("t", Role.PREFILL, "h:9")
    assert [w.address for w in pools.workers("t", Role.PREFILL)] == ["h:9"]
    with pytest.raises(InvalidArgument, match="already"):
        pools.add("t", Role.PREFILL, "h:9")
    with pytest.raises(InvalidArgument, match="unknown model"):
        pools.add("nope", Role.PREFILL, "h:8")
    with pytest.raises(InvalidArgument, match="host:port"):
        pools.add("t", Role.DECODE, "h")
    assert [w.address for w in pools.remove("h:9")] == ["h:9"]
    with pytest.raises(NotFound):
        pools.remove("h:9")
    assert pools.addresses() == ["h:1"]


def test_roles_map_to_the_wire() -> None:
    assert Role.from_proto(worker_pb2.WORKER_ROLE_COLOCATED) is Role.COLOCATED
    assert Role.PREFILL.proto == worker_pb2.WORKER_ROLE_PREFILL
    with pytest.raises(InvalidArgument):
        Role.from_proto(worker_pb2.WORKER_ROLE_UNSPECIFIED)


def test_fingerprint_comes_from_a_healthy_worker() -> None:
    pools = registry(tier("t", colocated=("h:1",)))
    assert pools.fingerprint("t") is None
    healthy(pools, "h:1")
    assert pools.fingerprint("t") == "fp"


def test_a_tiers_throughput_is_what_its_decoding_workers_measured() -> None:
    pools = registry(tier("t", prefill=("h:1",), decode=("h:2", "h:3")))
    healthy(pools, "h:1")
    healthy(pools, "h:2")
    assert pools.tokens_per_second("t") == 100.0  # the pools file's figure until measured
    for address, peak in (("h:1", 900.0), ("h:2", 150.0), ("h:3", 250.0)):
        measured = stats()
        measured.peak_tokens_per_second = peak
        pools.record_check(address, measured)
    # The prefill worker's first tokens are not one worker's generation throughput.
    assert pools.tokens_per_second("t") == 200.0
    pools.record_check("h:3", None, "UNAVAILABLE: gone")
    assert pools.tokens_per_second("t") == 150.0  # only workers in rotation count
