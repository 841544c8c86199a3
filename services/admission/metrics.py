"""Prometheus metrics of the admission gateway (vLLM names where one exists)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

TIME_TO_FIRST_TOKEN = Histogram(
    "kvmesh:time_to_first_token_seconds",
    "From arrival at the gateway to the first token sent to the client.",
    ["model", "priority"],
    buckets=_LATENCY_BUCKETS,
)
E2E_LATENCY = Histogram(
    "kvmesh:e2e_request_latency_seconds",
    "From arrival at the gateway to the Finished event.",
    ["model", "priority"],
    buckets=_LATENCY_BUCKETS,
)
QUEUE_TIME = Histogram(
    "kvmesh:request_queue_time_seconds",
    "Time spent waiting in the admission queue.",
    ["priority"],
    buckets=_LATENCY_BUCKETS,
)
REQUESTS_RUNNING = Gauge(
    "kvmesh:admission_requests_running", "Requests admitted toward the router.", ["priority"]
)
REQUESTS_WAITING = Gauge(
    "kvmesh:admission_requests_waiting", "Requests waiting in the admission queue.", ["priority"]
)
CONCURRENCY_LIMIT = Gauge(
    "kvmesh:admission_concurrency_limit",
    "Requests the gateway lets run toward the router at once now (adaptive or fixed).",
)
SERVICE_CALIBRATION = Gauge(
    "kvmesh:admission_service_calibration",
    "Factor on the workers' expected service time: recent requests' actual over expected (p75).",
)
WAIT_MARGIN = Gauge(
    "kvmesh:admission_wait_margin_seconds",
    "Seconds added to the expected queue wait: recent waits' overrun of their estimate (p90).",
    ["priority"],
)
REQUESTS_SHED = Counter(
    "kvmesh:requests_shed_total",
    "Requests refused by admission control, by priority and reason.",
    ["priority", "reason"],
)
REQUESTS_FINISHED = Counter(
    "kvmesh:request_success_total",
    "Requests that reached a Finished event, by model and finish reason.",
    ["model", "finished_reason"],
)
TENANT_TOKENS = Counter(
    "kvmesh:tenant_tokens_total",
    "Tokens metered per tenant and kind (prompt, cached_prompt, completion).",
    ["tenant", "kind"],
)
TENANT_COST = Counter("kvmesh:tenant_cost_usd_total", "Dollars metered per tenant.", ["tenant"])
RESPONSE_CACHE_LOOKUPS = Counter(
    "kvmesh:gateway_response_cache_lookups_total",
    "Response-cache lookups seen from the gateway, by result (hit, miss, error).",
    ["result"],
)
BACKEND_ERRORS = Counter(
    "kvmesh:admission_backend_errors_total",
    "Calls to a backing store or service that failed and were worked around.",
    ["backend"],
)
