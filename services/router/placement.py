"""Placement: which tier, which workers, and the reason, for one request.

- Tier: the requested one while it can serve; otherwise its fallback chain (marked fallback).
- Prefill (and colocated) worker: the tier's placement policy (services/router/policies; by
  default prefix-affinity: the longest cached prefix of this prompt, weighed against load).
- Decode worker: least-load (fewest requests on it, then most free KV blocks, then the one
  placed on least recently), among those of the prefill worker's revision (model
  fingerprint, KV layout, kvmesh release).
- A tier with a prefill and a decode worker in rotation runs split; otherwise colocated.
- Workers of a failed attempt are avoided on the retry while another one is in rotation.

The prompt's block hashes come from the shared hash chain (kvmesh/contracts/block_hashes.py),
so they equal the hashes the workers report for their cached blocks.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvmesh.contracts.block_hashes import hash_block_chain
from kvmesh.errors import Unavailable
from services.router.policies.base import Pick, PlacementPolicy, PromptQuery
from services.router.policies.least_load import LeastLoad
from services.router.pools import PoolRegistry, Role, WorkerState

_DECODE_POLICY = LeastLoad()


@dataclass(slots=True, frozen=True)
class TierChoice:
    """The tier that serves a request."""

    tier: str
    fallback: bool
    reason: str
    requested: str
    """The tier asked for ("auto" already resolved), before any fallback."""
    why: str = ""
    """How the requested tier was chosen (the "auto" rule's reason), kept for re-resolving."""


@dataclass(slots=True, frozen=True)
class Plan:
    """Where one attempt of a request runs."""

    tier: str
    fallback: bool
    prefill: WorkerState
    """The worker that runs the prompt: a prefill worker, or the colocated worker."""
    decode: WorkerState | None
    """The decode worker; None when colocated."""
    reason: str
    expected_prefix_hit_tokens: int

    @property
    def colocated(self) -> bool:
        return self.decode is None

    @property
    def workers(self) -> tuple[WorkerState, ...]:
        return (self.prefill,) if self.decode is None else (self.prefill, self.decode)


def resolve_tier(registry: PoolRegistry, requested: str, why: str = "") -> TierChoice:
    """The requested tier if it serves now, else the first serving tier down its fallback chain."""
    registry.tier(requested)
    prefix = f"{why}; " if why else ""
    tier, seen = requested, [requested]
    while not registry.serves(tier):
        fallback = registry.tier(tier).fallback
        if not fallback or fallback in seen:
            raise Unavailable(
                f"no healthy worker for model {requested!r}"
                + (f" nor its fallbacks {seen[1:]}" if len(seen) > 1 else "")
            )
        seen.append(fallback)
        tier = fallback
    if tier == requested:
        return TierChoice(requested, False, f"{prefix}tier {requested}", requested, why)
    return TierChoice(
        tier,
        fallback=True,
        reason=f"{prefix}fallback: {requested} has no healthy worker -> {tier}",
        requested=requested,
        why=why,
    )


def prompt_block_hashes(
    prompt_token_ids: Sequence[int], block_size: int, fingerprint: str, cache_salt: bytes
) -> list[bytes]:
    """Hashes of the prompt's full blocks, as the workers' prefix caches name them."""
    full = len(prompt_token_ids) // block_size * block_size
    return hash_block_chain(prompt_token_ids[:full], block_size, fingerprint, cache_salt)


def _pick(
    policy: PlacementPolicy, workers: list[WorkerState], query: PromptQuery, what: str
) -> Pick:
    if not workers:
        raise Unavailable(f"no {what} in rotation")
    return policy.pick(workers, query)


def place(
    registry: PoolRegistry,
    policy: PlacementPolicy,
    choice: TierChoice,
    prompt_token_ids: Sequence[int],
    cache_salt: bytes,
    load_cost_tokens: int,
    avoid: Collection[str] = (),
) -> Plan:
    """Chooses the workers for one attempt on the chosen tier; `policy` is that tier's."""
    tier = choice.tier
    stats = registry.stats_of(tier)
    block_size = stats.block_size if stats is not None and stats.block_size else 16
    fingerprint = registry.fingerprint(tier) or ""
    hashes = prompt_block_hashes(prompt_token_ids, block_size, fingerprint, cache_salt)
    query = PromptQuery(hashes, block_size, load_cost_tokens, avoid)
    if registry.can_split(tier):
        prefill = _pick(policy, registry.pairable_prefill(tier), query, "worker")
        decode = _pick(
            _DECODE_POLICY, registry.decode_partners(prefill.worker), query, "decode worker"
        )
        return Plan(
            tier=tier,
            fallback=choice.fallback,
            prefill=prefill.worker,
            decode=decode.worker,
            reason=f"{choice.reason}; split; prefill {prefill.reason}; decode {decode.reason}",
            expected_prefix_hit_tokens=prefill.prefix_hit_tokens,
        )
    colocated = _pick(policy, registry.in_rotation(tier, Role.COLOCATED), query, "worker")
    return Plan(
        tier=tier,
        fallback=choice.fallback,
        prefill=colocated.worker,
        decode=None,
        reason=f"{choice.reason}; colocated {colocated.reason}",
        expected_prefix_hit_tokens=colocated.prefix_hit_tokens,
    )
