"""Prometheus metrics of the response cache."""

from prometheus_client import Counter

LOOKUPS = Counter(
    "kvmesh:response_cache_lookups_total",
    "Response-cache lookups by backend and result (hit or miss).",
    ["backend", "result"],
)
STORES = Counter("kvmesh:response_cache_stores_total", "Entries stored, by backend.", ["backend"])
BACKEND_ERRORS = Counter(
    "kvmesh:response_cache_backend_errors_total",
    "Backend failures answered as misses, by backend and operation.",
    ["backend", "operation"],
)
