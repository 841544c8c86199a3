"""Every service's metrics can live in one process (the in-process tests need it) and
follow one naming scheme."""

from __future__ import annotations

import importlib

from prometheus_client import REGISTRY

METRIC_MODULES = (
    "services.admission.metrics",
    "services.cache.metrics",
    "services.router.metrics",
    "services.worker.metrics",
    "services.admission.openai_http.metrics",
    "kvmesh.grpc_server",
)


def test_metric_modules_import_together_without_name_clashes() -> None:
    for name in METRIC_MODULES:
        importlib.import_module(name)  # DuplicateTimeseries if two modules share a name
    names = {metric.name for metric in REGISTRY.collect()}
    ours = {n for n in names if n.startswith("kvmesh")}
    assert {
        "kvmesh:time_to_first_token_seconds",
        "kvmesh:inter_token_latency_seconds",
        "kvmesh:num_requests_running",
        "kvmesh:kv_cache_usage_perc",
        "kvmesh:response_cache_lookups",
        "kvmesh:gateway_response_cache_lookups",
        "kvmesh:tenant_cost_usd",
    } <= ours
