"""Settings of the admission gateway (flags > KVMESH_ADMISSION_* environment > defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kvmesh.config import ServerConfig
from kvmesh.contracts.sampling import DEFAULT_MAX_TOKENS


@dataclass(slots=True, frozen=True)
class AdmissionConfig(ServerConfig):
    """The admission gateway: tenants, budgets, priority queue, response cache, router."""

    env_prefix: ClassVar[str] = "KVMESH_ADMISSION_"

    port: int = 50051
    """gRPC port of the gateway; 0 picks a free one."""
    metrics_port: int = 9451
    """Prometheus metrics HTTP port; 0 picks a free one, -1 disables the endpoint."""
    http_port: int = 8000
    """Port of the OpenAI-compatible HTTP door (POST /v1/chat/completions and /v1/completions,
    GET /v1/models and /health; docs/openai_http.md), served by this process on --host; 0
    picks a free one, -1 serves none."""
    http_max_prompts: int = 32
    """Most prompts in one HTTP /v1/completions request (each is its own request)."""
    router: str = "127.0.0.1:50052"
    """Address (host:port) of the router that places requests."""
    cache: str = ""
    """Address of the response cache service; empty runs without a response cache."""
    redis: str = ""
    """Redis URL for shared budgets, concurrency limits and usage meters (several gateways, one
    limit); empty keeps them in this process."""
    redis_prefix: str = "kvmesh:admission:"
    """Prefix of every Redis key the gateway writes."""
    concurrency_lease_s: float = 30.0
    """Lease of a request's slot against its tenant's max_concurrent in Redis: each gateway
    renews its slots every third of it, and the slots of a gateway that dies are freed within
    it."""
    tenants: Path | None = None
    """YAML file of tenants (hashed keys and limits); without it the gateway binds 127.0.0.1
    only and serves one unlimited local tenant."""
    model_path: tuple[str, ...] = ()
    """Tokenizer source per tier, comma-separated TIER=SPEC (folder, .gguf or a known name)."""
    default_tokenizer: str = "smollm2-135m"
    """Tokenizer SPEC for tiers not named in --model-path."""
    default_model: str = ""
    """Tier used when a request names no model; empty means the router's first tier."""
    price: tuple[str, ...] = ()
    """Price overrides, comma-separated TIER=USD_PER_GPU_HOUR:TOKENS_PER_SECOND."""
    default_usd_per_gpu_hour: float = 2.0
    """Price of an accelerator hour for tiers with no configured or reported price."""
    default_tokens_per_second: float = 100.0
    """Throughput assumed for tiers whose workers have not reported a measured one yet."""
    adaptive_admission: bool = True
    """Admission that knows what the workers can do: requests in flight bounded by a limit
    that follows their measured latency per token and the deadlines they miss (a gradient
    limit, TCP-Vegas style, between --min-in-flight and --max-in-flight), and a request shed
    at once when its expected wait plus the workers' measured time for its prompt and
    max_tokens exceeds its deadline. --no-adaptive-admission: a fixed --max-in-flight, shed
    only when the wait alone exceeds the deadline."""
    workers_batch: int = 64
    """Requests the workers batch at once (max_num_seqs summed over the decode workers; one
    worker's 64 in kvmesh up's default stack): the adaptive limit starts there, and latency
    that grows with the batch never takes it lower (a part-empty batch serves less)."""
    min_in_flight: int = 4
    """The adaptive limit's floor, reached only while more than a tenth of the requests miss
    the deadlines their admission expected them to meet (the batch is then too large for the
    deadlines); without such misses the limit returns to --workers-batch."""
    max_in_flight: int = 256
    """Most requests admitted toward the router at once (the adaptive limit's ceiling; the
    limit itself with --no-adaptive-admission)."""
    batch_max_in_flight: int = 192
    """Batch requests' share of the slots, as a count of --max-in-flight's (the adaptive
    limit gives batch the same fraction), so interactive ones always find a slot; kept only
    while interactive requests are about (running, waiting, or started within the last hold
    period): with none, batch work may take every slot."""
    interactive_queue: int = 256
    """Interactive requests that may wait for a slot; more are shed."""
    batch_queue: int = 1024
    """Batch requests that may wait for a slot; more are shed."""
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    """max_tokens of requests that set none (lowered to fit the model's context)."""
    max_tokens_limit: int = 4096
    """Largest max_tokens a request may ask for."""
    max_stop_strings: int = 8
    """Most stop strings per request."""
    idempotency_entries: int = 10_000
    """Finished results remembered for idempotency keys (oldest forgotten first)."""
    idempotency_ttl_s: float = 3600.0
    """How long a finished result answers a repeated idempotency key."""
    catalog_refresh_s: float = 2.0
    """How often the model list is fetched again from the router (it carries the workers'
    measured rates that shedding goes by, so they follow a change of load this closely)."""
    cache_timeout_s: float = 0.5
    """Deadline of a response-cache call; slower counts as a miss."""
    cancel_grace_s: float = 2.0
    """Time the router gets to end a cancelled stream before the call is cut."""
    log_requests: bool = False
    """Log one line per finished request (tenant, model, tokens, TTFT, finish reason)."""
