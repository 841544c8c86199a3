"""Prometheus metrics of a worker, named after vLLM's where one exists (vllm: -> kvmesh:)."""

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)

REQUESTS_RUNNING = Gauge("kvmesh:num_requests_running", "Requests being computed by the engine.")
REQUESTS_WAITING = Gauge("kvmesh:num_requests_waiting", "Requests queued in the engine.")
KV_CACHE_USAGE = Gauge("kvmesh:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).")
PREFIX_CACHE_HIT_RATE = Gauge(
    "kvmesh:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache, fraction (0..1)."
)
LEASES_ACTIVE = Gauge("kvmesh:kv_leases_active", "KV leases held by this worker now.")
LEASES = Counter(
    "kvmesh:kv_leases", "KV leases by how they ended (granted, released, expired).", ["event"]
)
KV_TRANSFER_BYTES = Counter(
    "kvmesh:kv_transfer_bytes",
    "KV bytes moved between workers, by direction (sent by PullKv, received by Decode).",
    ["direction"],
)
KV_TRANSFER_BLOCKS = Counter(
    "kvmesh:kv_transfer_blocks", "KV blocks moved between workers, by direction.", ["direction"]
)
KV_TRANSFER_SECONDS = Histogram(
    "kvmesh:kv_transfer_seconds",
    "Time a decode worker spent pulling the missing blocks of one request.",
    buckets=_LATENCY_BUCKETS,
)
REQUEST_PREFILL_SECONDS = Histogram(
    "kvmesh:request_prefill_time_seconds",
    "From arrival at the worker to the first token (prefill, or import on a decode worker).",
    ["rpc"],
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "kvmesh:inter_token_latency_seconds",
    "Time between consecutive streamed chunks divided by the tokens they carry.",
    ["rpc"],
    buckets=_LATENCY_BUCKETS,
)
REQUESTS_FINISHED = Counter(
    "kvmesh:worker_requests_finished",
    "Requests that ended, by RPC and finish reason.",
    ["rpc", "reason"],
)
GENERATION_TOKENS = Counter(
    "kvmesh:generation_tokens", "Tokens generated and streamed, by RPC.", ["rpc"]
)
