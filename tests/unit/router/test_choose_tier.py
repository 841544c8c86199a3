"""Which tier a request's model resolves to: explicit, "auto" with and without a rule."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.mesh_auth import ROUTER_MEMBER_NAME, MeshMember, MeshRole
from kvmesh.mesh_keys import MeshKeys
from kvmesh.v1 import common_pb2
from services.router.monitor import WorkerMonitor
from services.router.orchestrator import Orchestrator
from services.router.peers import Peers
from services.router.pools import PoolRegistry
from services.router.tiers import AutoRule
from services.router.worker_client import GrpcWorkers
from tests.unit.router.factories import healthy, registry, tier


def _orchestrator(pools: PoolRegistry) -> Orchestrator:
    peers = Peers(MeshMember(MeshRole.ROUTER, ROUTER_MEMBER_NAME, MeshKeys.from_secret("")))
    monitor = WorkerMonitor(pools, peers, 1.0, 1.0)
    return Orchestrator(pools, GrpcWorkers(peers), monitor, load_cost_tokens=64)


def _request(model: str, prompt_tokens: int, max_tokens: int) -> common_pb2.InferenceRequest:
    return common_pb2.InferenceRequest(
        model=model,
        prompt_token_ids=[1] * prompt_tokens,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
    )


def test_auto_follows_the_rule_then_the_fallback() -> None:
    pools = registry(
        tier("big", colocated=("b:1",), fallback="small"),
        tier("small", colocated=("s:1",)),
        auto=AutoRule(cheap="small", full="big", max_prompt_tokens=8, max_output_tokens=8),
    )
    healthy(pools, "b:1")
    healthy(pools, "s:1")
    orchestrator = _orchestrator(pools)
    assert orchestrator.choose_tier(_request("auto", 4, 4)).tier == "small"
    hard = orchestrator.choose_tier(_request("auto", 40, 4))
    assert (hard.tier, hard.fallback) == ("big", False)
    pools.record_check("b:1", None, "down")
    fallen = orchestrator.choose_tier(_request("auto", 40, 4))
    assert (fallen.tier, fallen.fallback, fallen.requested) == ("small", True, "big")
    assert fallen.reason.startswith("auto: prompt 40 tokens")


def test_auto_without_a_rule_takes_the_first_tier() -> None:
    pools = registry(tier("only", colocated=("o:1",)))
    healthy(pools, "o:1")
    choice = _orchestrator(pools).choose_tier(_request("auto", 4, 4))
    assert choice.tier == "only" and "no rule configured" in choice.reason


def test_a_model_must_be_named() -> None:
    pools = registry(tier("only", colocated=("o:1",)))
    with pytest.raises(InvalidArgument, match="model"):
        _orchestrator(pools).choose_tier(_request("", 4, 4))
    with pytest.raises(InvalidArgument, match="unknown model 'nope'"):
        _orchestrator(pools).choose_tier(_request("nope", 4, 4))
