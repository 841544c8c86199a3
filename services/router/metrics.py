"""Prometheus metrics of the router."""

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)

PLACEMENTS = Counter(
    "kvmesh:router_placements",
    "Requests placed, by tier, mode (split or colocated) and whether it was a fallback.",
    ["tier", "mode", "fallback"],
)
RETRIES = Counter(
    "kvmesh:router_retries",
    "Attempts that failed before the first token and were retried.",
    ["tier", "code"],
)
FAILURES_AFTER_FIRST_TOKEN = Counter(
    "kvmesh:router_failures_after_first_token",
    "Requests that broke after their first token (UNAVAILABLE to the caller, not re-run).",
    ["tier"],
)
TIME_TO_FIRST_TOKEN = Histogram(
    "kvmesh:router_time_to_first_token_seconds",
    "From arrival at the router to the first token forwarded, by tier.",
    ["tier"],
    buckets=_LATENCY_BUCKETS,
)
HEALTHY_WORKERS = Gauge(
    "kvmesh:router_workers_in_rotation", "Workers in rotation, by tier and pool.", ["tier", "pool"]
)
RECOMMENDED_REPLICAS = Gauge(
    "kvmesh:router_recommended_replicas",
    "Replicas each pool should have for its load (throughput, KV usage, queue) plus the warm"
    " buffer, by tier and pool.",
    ["tier", "pool"],
)
