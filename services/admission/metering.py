"""Per-tenant, per-model usage meters: requests, tokens and dollars.

Kept in Redis hashes when gateways share a Redis (so `Usage` reports the whole fleet), in
this process otherwise. What cannot be written to Redis while it is down is kept locally
and still reported by this gateway.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.admission import metrics
from services.admission.pricing import TokenCounts

log = logging.getLogger(__name__)

_SEPARATOR = "\x1f"


@dataclass(slots=True)
class ModelTotals:
    """Summed usage of one tenant on one tier."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    response_cache_hits: int = 0
    cost_usd: float = 0.0
    response_cache_tokens: int = 0
    """Tokens the response cache delivered (the hits' answers; not in completion_tokens)."""

    def add(self, other: ModelTotals) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @classmethod
    def of_request(cls, tokens: TokenCounts, cost_usd: float) -> ModelTotals:
        return cls(
            requests=1,
            prompt_tokens=tokens.prompt_tokens,
            cached_prompt_tokens=tokens.cached_prompt_tokens,
            completion_tokens=tokens.completion_tokens,
            response_cache_hits=int(tokens.response_cache_hit),
            response_cache_tokens=tokens.delivered_tokens,
            cost_usd=cost_usd,
        )


class UsageMeter(Protocol):
    """Where usage is summed."""

    async def record(self, tenant: str, model: str, usage: ModelTotals) -> None: ...

    async def totals(self, tenant: str) -> dict[str, ModelTotals]: ...


class MemoryMeter:
    """Usage in this process."""

    def __init__(self) -> None:
        self._totals: dict[str, dict[str, ModelTotals]] = {}

    async def record(self, tenant: str, model: str, usage: ModelTotals) -> None:
        self._totals.setdefault(tenant, {}).setdefault(model, ModelTotals()).add(usage)
        _export(tenant, usage)

    async def totals(self, tenant: str) -> dict[str, ModelTotals]:
        return {model: _copy(totals) for model, totals in self._totals.get(tenant, {}).items()}


class RedisMeter:
    """Usage in a Redis hash per tenant (kept locally while Redis is down)."""

    def __init__(self, client: Redis, prefix: str) -> None:
        self._client = client
        self._prefix = prefix
        self._local = MemoryMeter()

    def _key(self, tenant: str) -> str:
        return f"{self._prefix}usage:{{{tenant}}}"

    async def record(self, tenant: str, model: str, usage: ModelTotals) -> None:
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                for f in fields(usage):
                    value = getattr(usage, f.name)
                    name = f"{model}{_SEPARATOR}{f.name}"
                    if isinstance(value, float):
                        pipe.hincrbyfloat(self._key(tenant), name, value)
                    else:
                        pipe.hincrby(self._key(tenant), name, value)
                await pipe.execute()
        except RedisError as error:
            metrics.BACKEND_ERRORS.labels("metering").inc()
            log.warning("cannot meter usage in Redis (%s): kept locally", error)
            await self._local.record(tenant, model, usage)
            return
        _export(tenant, usage)

    async def totals(self, tenant: str) -> dict[str, ModelTotals]:
        result = await self._local.totals(tenant)
        try:
            stored = await self._client.hgetall(self._key(tenant))
        except RedisError as error:
            metrics.BACKEND_ERRORS.labels("metering").inc()
            log.warning("cannot read usage from Redis (%s): reporting this gateway's only", error)
            return result
        for raw_name, raw_value in stored.items():
            name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
            model, _, field_name = name.rpartition(_SEPARATOR)
            totals = result.setdefault(model, ModelTotals())
            current = getattr(totals, field_name, None)
            if current is None:
                continue  # a field a newer gateway version wrote
            kind = float if isinstance(current, float) else int
            setattr(totals, field_name, current + kind(float(raw_value)))
        return result


def _export(tenant: str, usage: ModelTotals) -> None:
    """Adds a request's usage to the Prometheus per-tenant counters."""
    metrics.TENANT_TOKENS.labels(tenant, "prompt").inc(usage.prompt_tokens)
    metrics.TENANT_TOKENS.labels(tenant, "cached_prompt").inc(usage.cached_prompt_tokens)
    metrics.TENANT_TOKENS.labels(tenant, "completion").inc(usage.completion_tokens)
    metrics.TENANT_COST.labels(tenant).inc(usage.cost_usd)


def _copy(totals: ModelTotals) -> ModelTotals:
    copy = ModelTotals()
    copy.add(totals)
    return copy
