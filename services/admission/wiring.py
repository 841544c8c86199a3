"""Builds a Gateway and its clients from the configuration."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from redis.asyncio import Redis

from kvmesh.channels import member_channel
from kvmesh.grpc_server import StopHook
from kvmesh.mesh_auth import GATEWAY_MEMBER_NAME, MeshMember, MeshRole
from kvmesh.mesh_keys import MeshKeys
from kvmesh.tenants import TenantRegistry
from kvmesh.tls import tls_of
from services.admission.admission_queue import AdmissionQueue, QueueLimits
from services.admission.catalog import ModelCatalog, parse_tier_map
from services.admission.concurrency import ConcurrencyLimits, MemorySlots, RedisSlots
from services.admission.config import AdmissionConfig
from services.admission.downstream import CacheClient, RouterClient
from services.admission.gateway import Gateway
from services.admission.idempotency import IdempotencyStore
from services.admission.limiter import FixedLimit, GradientLimit, GradientSettings
from services.admission.metering import MemoryMeter, RedisMeter, UsageMeter
from services.admission.pricing import PriceTable, parse_price_overrides
from services.admission.quotas import MemoryCounters, Quotas, RedisCounters
from services.admission.transcript import Transcript
from services.admission.validation import RequestLimits

log = logging.getLogger(__name__)

REDIS_TIMEOUT_S = 0.5
"""Socket timeouts of Redis calls: a stalled Redis must not stall admission."""


@dataclass(slots=True)
class Assembly:
    """A built gateway and what must be closed when it stops."""

    gateway: Gateway
    on_stop: list[StopHook] = field(default_factory=list)


def open_tenants(config: AdmissionConfig) -> TenantRegistry:
    if config.tenants is None:
        return TenantRegistry.open_local()
    return TenantRegistry.from_file(config.tenants)


@dataclass(slots=True, frozen=True)
class TenantBooks:
    """What the gateway counts per tenant: token budgets, requests in flight, usage."""

    quotas: Quotas
    concurrency: ConcurrencyLimits
    meter: UsageMeter


def tenant_books(config: AdmissionConfig, hooks: list[StopHook]) -> TenantBooks:
    """In Redis when configured (so gateways sharing it enforce one limit), with local
    fallbacks for while it is unreachable; in this process otherwise."""
    if not config.redis:
        return TenantBooks(
            Quotas(MemoryCounters()), ConcurrencyLimits(MemorySlots()), MemoryMeter()
        )
    redis = Redis.from_url(
        config.redis, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
    )
    slots = RedisSlots(redis, config.redis_prefix, config.concurrency_lease_s)
    limits = ConcurrencyLimits(slots, fallback=MemorySlots(), lease_s=config.concurrency_lease_s)
    quotas = Quotas(RedisCounters(redis, config.redis_prefix), fallback=MemoryCounters())
    hooks += [quotas.close, limits.close, slots.close, redis.aclose]
    return TenantBooks(quotas, limits, RedisMeter(redis, config.redis_prefix))


def admission_queue(config: AdmissionConfig) -> AdmissionQueue:
    """The queue with the adaptive limit and the service-time rule, or the fixed limit."""
    limits = QueueLimits(
        max_in_flight=config.max_in_flight,
        batch_max_in_flight=min(config.batch_max_in_flight, config.max_in_flight),
        interactive_queue=config.interactive_queue,
        batch_queue=config.batch_queue,
    )
    if not config.adaptive_admission:
        return AdmissionQueue(limits, FixedLimit(config.max_in_flight))
    batch = min(config.workers_batch, config.max_in_flight)
    settings = GradientSettings(
        batch=batch, min_limit=min(config.min_in_flight, batch), max_limit=config.max_in_flight
    )
    return AdmissionQueue(limits, GradientLimit(settings), service_aware=True)


def build_gateway(config: AdmissionConfig) -> Assembly:
    """The Gateway for `config` (channels connect lazily: nothing is contacted yet)."""
    # Every call to the router and the cache carries the gateway's mesh identity.
    member = MeshMember(
        MeshRole.GATEWAY,
        GATEWAY_MEMBER_NAME,
        MeshKeys.from_file(config.mesh_secret_file),
        tls_of(config),
    )
    # Untraced: requests share one GenerateMany call, each carrying its own trace context, and
    # the model list is polled in the background, with no trace per poll.
    router_channel = member_channel(config.router, member, traced=False)
    router = RouterClient(router_channel, cancel_grace_s=config.cancel_grace_s)
    hooks: list[StopHook] = []
    cache = None
    if config.cache:
        cache_channel = member_channel(config.cache, member)
        cache = CacheClient(cache_channel, timeout_s=config.cache_timeout_s)
        hooks.append(lambda: cache_channel.close())
    books = tenant_books(config, hooks)
    catalog = ModelCatalog(
        router.list_models,
        tokenizer_specs=parse_tier_map(config.model_path, "model_path"),
        default_tokenizer=config.default_tokenizer,
        default_model=config.default_model,
        refresh_s=config.catalog_refresh_s,
    )
    gateway = Gateway(
        tenants=open_tenants(config),
        catalog=catalog,
        router=router,
        cache=cache,
        quotas=books.quotas,
        concurrency=books.concurrency,
        meter=books.meter,
        queue=admission_queue(config),
        prices=PriceTable(
            parse_price_overrides(config.price),
            default_usd_per_gpu_hour=config.default_usd_per_gpu_hour,
            default_tokens_per_second=config.default_tokens_per_second,
        ),
        limits=RequestLimits(
            default_max_tokens=config.default_max_tokens,
            max_tokens_limit=config.max_tokens_limit,
            max_stop_strings=config.max_stop_strings,
        ),
        idempotency=IdempotencyStore[Transcript](
            config.idempotency_entries, config.idempotency_ttl_s
        ),
    )
    return Assembly(gateway, [gateway.close, catalog.close, *hooks, lambda: router_channel.close()])
