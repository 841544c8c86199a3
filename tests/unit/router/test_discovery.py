"""dns:/// pool entries and revision pairing, below the router's DNS loop
(tests/service/test_router_discovery.py runs the loop against a real DNS server)."""

from __future__ import annotations

import pytest

from kvmesh.v1 import common_pb2
from services.router.discovery import (
    DnsTarget,
    PoolTarget,
    dns_target,
    split_dns_entries,
    worker_address,
)
from services.router.placement import TierChoice, place
from services.router.policies.prefix_affinity import PrefixAffinity
from services.router.pools import Role
from services.router.tiers import PoolsConfig
from tests.unit.router.factories import registry, stats, tier


def test_dns_entries_are_taken_out_and_static_ones_stay() -> None:
    config = PoolsConfig(
        tiers=(tier("t", prefill=("dns:///prefill:50061", "10.0.0.9:50061"), colocated=()),),
        auto=None,
    )
    static, targets = split_dns_entries(config)
    assert static.tiers[0].prefill == ("10.0.0.9:50061",)
    assert targets == [PoolTarget("t", Role.PREFILL, DnsTarget("prefill", 50061))]
    assert str(targets[0].target) == "dns:///prefill:50061"
    assert dns_target("prefill.kvmesh.svc.cluster.local:50061") is None


@pytest.mark.parametrize("entry", ["dns:///prefill", "dns:///:50061", "dns:///p:0", "dns:///p:x"])
def test_a_malformed_dns_entry_is_refused(entry: str) -> None:
    with pytest.raises(ValueError, match="is not dns:///NAME:PORT"):
        dns_target(entry)


def test_ipv6_addresses_are_bracketed() -> None:
    assert worker_address("10.1.2.3", 50061) == "10.1.2.3:50061"
    assert worker_address("fd00::7", 50061) == "[fd00::7]:50061"


@pytest.mark.parametrize(
    "differs",
    ["model_fingerprint", "kvmesh_version", "layout"],
)
def test_prefill_and_decode_pair_only_within_one_revision(differs: str) -> None:
    pools = registry(tier("t", prefill=("p:1",), decode=("old:2", "new:2")))
    layout = common_pb2.KvLayout(dtype="float32", block_size=16, num_layers=2, engine="native")
    for address in ("p:1", "old:2", "new:2"):
        reported = stats()
        reported.kvmesh_version = "0.1.0"
        reported.layout.CopyFrom(layout)
        if address == "new:2":
            if differs == "layout":
                reported.layout.block_size = 32
            else:
                setattr(reported, differs, "other")
        pools.record_check(address, reported)
    old, new = pools.workers("t", Role.DECODE)
    new.inflight = 0
    old.inflight = 5  # busier: the pick on load alone would be new:2
    (prefill,) = pools.workers("t", Role.PREFILL)
    assert pools.decode_partners(prefill) == [old]
    choice = TierChoice("t", False, "tier t", "t")
    assert place(pools, PrefixAffinity(), choice, list(range(40)), b"", 64).decode is old
    pools.record_check("old:2", None, "gone")
    assert not pools.can_split("t")  # a decode worker in rotation, but of another revision
