"""Placement policies, chosen per tier in the pools file."""

from __future__ import annotations

import pytest

from services.router.placement import place, resolve_tier
from services.router.policies import POLICIES
from services.router.policies.base import PromptQuery
from services.router.policies.least_load import LeastLoad
from services.router.policies.prefix_affinity import PrefixAffinity
from services.router.policies.round_robin import RoundRobin
from services.router.pools import Role
from services.router.tiers import TierConfigError, parse_pools
from tests.unit.router.factories import healthy, registry, tier

PROMPT = list(range(64))  # 4 full blocks of 16


def test_round_robin_takes_each_worker_in_turn_and_skips_avoided_ones() -> None:
    pools = registry(tier("t", colocated=("c:2", "c:1", "c:3")))
    for address, running in (("c:1", 5), ("c:2", 0), ("c:3", 9)):
        healthy(pools, address, running=running)
    workers = pools.in_rotation("t", Role.COLOCATED)
    policy = RoundRobin()
    turns = [policy.pick(workers, PromptQuery([], 16, 0)).worker.address for _ in range(4)]
    assert turns == ["c:1", "c:2", "c:3", "c:1"]  # load does not matter
    assert policy.pick(workers, PromptQuery([], 16, 0, avoid={"c:2"})).worker.address == "c:3"


def test_least_load_ignores_a_cached_prefix() -> None:
    pools = registry(tier("t", colocated=("c:1", "c:2")))
    hashes = [bytes([i]) * 16 for i in range(4)]
    healthy(pools, "c:1", hashes=hashes, running=1)
    healthy(pools, "c:2", running=0)
    workers = pools.in_rotation("t", Role.COLOCATED)
    query = PromptQuery(hashes, 16, 0)
    assert PrefixAffinity().pick(workers, query).worker.address == "c:1"
    pick = LeastLoad().pick(workers, query)
    assert (pick.worker.address, pick.prefix_hit_tokens) == ("c:2", 0)


def test_place_uses_the_tiers_policy_for_the_prompt_worker() -> None:
    pools = registry(tier("t", prefill=("p:1", "p:2"), decode=("d:1",)))
    for address in ("p:1", "p:2", "d:1"):
        healthy(pools, address)
    policy = RoundRobin()
    plans = [place(pools, policy, resolve_tier(pools, "t"), PROMPT, b"", 32) for _ in range(2)]
    assert [plan.prefill.address for plan in plans] == ["p:1", "p:2"]
    assert "next in turn" in plans[0].reason
    assert all(plan.decode is not None and plan.decode.address == "d:1" for plan in plans)


def test_the_pools_file_names_a_policy_per_tier() -> None:
    config = parse_pools(
        {
            "tiers": [
                {"name": "a", "colocated": ["h:1"], "placement": "round-robin"},
                {"name": "b", "colocated": ["h:2"]},
            ]
        }
    )
    assert [t.placement for t in config.tiers] == ["round-robin", "prefix-affinity"]
    assert set(POLICIES) == {"prefix-affinity", "least-load", "round-robin"}
    with pytest.raises(TierConfigError, match="placement 'fastest' is not one of prefix-affinity"):
        parse_pools({"tiers": [{"name": "a", "placement": "fastest"}]})
