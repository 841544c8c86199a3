"""Tier resolution with fallback, prefix-affinity and load placement."""

from __future__ import annotations

import pytest

from kvmesh.contracts.block_hashes import hash_block_chain
from kvmesh.errors import Unavailable
from services.router.placement import place, prompt_block_hashes, resolve_tier
from services.router.policies.base import Pick, PromptQuery
from services.router.policies.least_load import LeastLoad
from services.router.policies.prefix_affinity import PrefixAffinity, leading_hits
from services.router.pools import Role, WorkerState
from tests.unit.router.factories import FINGERPRINT, healthy, registry, tier

PROMPT = list(range(100, 180))  # 5 full blocks of 16


def _hashes(tokens: list[int], salt: bytes = b"") -> list[bytes]:
    return prompt_block_hashes(tokens, 16, FINGERPRINT, salt)


def pick_by_prefix(
    workers: list[WorkerState], hashes: list[bytes], block_size: int, load_cost_tokens: int
) -> Pick:
    return PrefixAffinity().pick(workers, PromptQuery(hashes, block_size, load_cost_tokens))


def pick_decode(workers: list[WorkerState]) -> Pick:
    return LeastLoad().pick(workers, PromptQuery([], 16, 0))


def test_prompt_hashes_are_the_engines_full_block_chain() -> None:
    hashes = _hashes([*PROMPT, 1, 2, 3])  # the partial last block is never cached
    assert hashes == hash_block_chain(PROMPT, 16, FINGERPRINT)
    assert len(hashes) == 5
    assert _hashes(PROMPT, b"tenant-a") != hashes  # salts isolate tenants


def test_leading_hits_stop_at_the_first_miss() -> None:
    a, b, c = b"a", b"b", b"c"
    assert leading_hits([a, b, c], {a, b, c}) == 3
    assert leading_hits([a, b, c], {a, c}) == 1
    assert leading_hits([a, b, c], {b, c}) == 0


def test_prefill_prefers_the_longest_cached_prefix() -> None:
    pools = registry(tier("t", prefill=("p:1", "p:2"), decode=("d:1",)))
    hashes = _hashes(PROMPT)
    healthy(pools, "p:1", hashes=hashes[:1])
    healthy(pools, "p:2", hashes=hashes[:4])
    pick = pick_by_prefix(pools.in_rotation("t", Role.PREFILL), hashes, 16, load_cost_tokens=32)
    assert pick.worker.address == "p:2"
    assert pick.prefix_hit_tokens == 64
    assert "64 cached prefix tokens" in pick.reason


def test_load_outweighs_a_short_prefix_advantage() -> None:
    pools = registry(tier("t", prefill=("p:1", "p:2"), decode=("d:1",)))
    hashes = _hashes(PROMPT)
    healthy(pools, "p:1")
    # 32 more cached tokens, but 2 requests at 32 tokens each: 32 - 64 < 0.
    healthy(pools, "p:2", hashes=hashes[:2], running=2)
    workers = pools.in_rotation("t", Role.PREFILL)
    assert pick_by_prefix(workers, hashes, 16, load_cost_tokens=32).worker.address == "p:1"
    # With load cheap, the cached prefix wins.
    assert pick_by_prefix(workers, hashes, 16, load_cost_tokens=8).worker.address == "p:2"


def test_decode_prefers_fewest_requests_then_most_free_kv() -> None:
    pools = registry(tier("t", prefill=("p:1",), decode=("d:1", "d:2", "d:3")))
    healthy(pools, "d:1", running=3, free=90)
    healthy(pools, "d:2", running=1, free=10)
    healthy(pools, "d:3", running=1, free=50)
    pick = pick_decode(pools.in_rotation("t", Role.DECODE))
    assert pick.worker.address == "d:3"
    assert "1 requests, 50/100 KV blocks free" in pick.reason


def test_idle_decode_workers_take_turns_when_requests_come_one_at_a_time() -> None:
    # The second decode worker was added later (a scale-up): a tie on load and free KV goes to
    # the worker placed on least recently, so the newcomer serves without concurrency.
    pools = registry(tier("t", prefill=("p:1",), decode=("d:1", "d:2")))
    for address in ("p:1", "d:1", "d:2"):
        healthy(pools, address)
    decoders = []
    for _ in range(4):
        plan = place(pools, PrefixAffinity(), resolve_tier(pools, "t"), PROMPT, b"", 32)
        pools.occupy(plan.workers)
        assert plan.decode is not None
        decoders.append(plan.decode.address)
        pools.vacate(plan.workers)  # finished before the next one arrives
    assert decoders == ["d:1", "d:2", "d:1", "d:2"]
    assert all(w.inflight == 0 for w in pools.workers())


def test_a_placed_attempt_counts_until_it_is_vacated() -> None:
    pools = registry(tier("t", prefill=("p:1",), decode=("d:1", "d:2")))
    for address in ("p:1", "d:1", "d:2"):
        healthy(pools, address)
    first = place(pools, PrefixAffinity(), resolve_tier(pools, "t"), PROMPT, b"", 32)
    pools.occupy(first.workers)
    second = place(pools, PrefixAffinity(), resolve_tier(pools, "t"), PROMPT, b"", 32)
    assert first.decode is not None and second.decode is not None
    assert (first.decode.address, second.decode.address) == ("d:1", "d:2")
    assert "d:2: 0 requests" in second.reason
    assert [w.load for w in pools.workers()] == [1, 1, 0]


def test_avoided_workers_are_used_only_without_alternative() -> None:
    pools = registry(tier("t", prefill=("p:1", "p:2"), decode=("d:1",)))
    for address in ("p:1", "p:2", "d:1"):
        healthy(pools, address)
    choice = resolve_tier(pools, "t")
    plan = place(pools, PrefixAffinity(), choice, PROMPT, b"", 32, avoid={"p:1", "d:1"})
    assert plan.prefill.address == "p:2"
    assert plan.decode is not None and plan.decode.address == "d:1"


def test_split_when_both_pools_serve_else_colocated() -> None:
    pools = registry(tier("t", prefill=("p:1",), decode=("d:1",), colocated=("c:1",)))
    for address in ("p:1", "d:1", "c:1"):
        healthy(pools, address)
    split = place(pools, PrefixAffinity(), resolve_tier(pools, "t"), PROMPT, b"", 32)
    assert not split.colocated and "split" in split.reason
    pools.record_check("d:1", None, "down")
    colocated = place(pools, PrefixAffinity(), resolve_tier(pools, "t"), PROMPT, b"", 32)
    assert colocated.colocated and colocated.prefill.address == "c:1"
    assert colocated.workers == (colocated.prefill,)


def test_fallback_down_the_chain_is_marked() -> None:
    pools = registry(
        tier("big", colocated=("b:1",), fallback="mid"),
        tier("mid", colocated=("m:1",), fallback="small"),
        tier("small", colocated=("s:1",)),
    )
    healthy(pools, "b:1")
    healthy(pools, "s:1")
    assert resolve_tier(pools, "big").fallback is False
    pools.record_check("b:1", None, "down")
    choice = resolve_tier(pools, "big", "auto: long prompt")
    assert (choice.tier, choice.fallback, choice.requested) == ("small", True, "big")
    assert choice.reason == "auto: long prompt; fallback: big has no healthy worker -> small"
    pools.record_check("s:1", None, "down")
    with pytest.raises(Unavailable, match="nor its fallbacks"):
        resolve_tier(pools, "big")


def test_fallback_cycles_end() -> None:
    pools = registry(tier("a", colocated=("a:1",), fallback="b"), tier("b", fallback="a"))
    with pytest.raises(Unavailable):
        resolve_tier(pools, "a")
