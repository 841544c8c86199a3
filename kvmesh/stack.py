"""The plan of a whole kvmesh stack: which services, with which flags and ports.

`kvmesh up` starts exactly this plan as local processes; docker-compose.yml describes the
same services as containers, and a test checks that the two agree, so they never drift.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from kvmesh.mesh_auth import MeshRole, certificate_name
from kvmesh.tls import CA_CERT, TlsFiles

Mode = Literal["disaggregated", "colocated"]

GATEWAY_PORT = 50051
ROUTER_PORT = 50052
CACHE_PORT = 50053
FIRST_WORKER_PORT = 50061
OPENAI_HTTP_PORT = 8000
GATEWAY_METRICS_PORT = 9451
ROUTER_METRICS_PORT = 9452
CACHE_METRICS_PORT = 9453
FIRST_WORKER_METRICS_PORT = 9461

WORKER_GRACE_S = 30.0
"""Seconds a stopping (drained) worker gives its in-flight requests to finish."""

WORKER_ROLES = ("prefill", "decode", "colocated")

SHARED_CORES_ENV = (("OMP_WAIT_POLICY", "PASSIVE"),)
"""The environment of a native worker that shares the machine's cores with other workers.

Each worker's torch takes as many OpenMP threads as the machine has cores, and libgomp lets a
thread that waits at a barrier spin for some 300,000 rounds while its process alone does not
outnumber the cores. Two such workers on one machine then burn each other's cores spinning: the
disaggregated serving row of BENCHMARKS.md "Peers" fell to 61 output tok/s, and 121 with a
passive wait (the same run, AMD EPYC, 2 cores). libgomp reads it when torch loads, so it must be
in the environment the process starts with."""


@dataclass(slots=True, frozen=True)
class StackOptions:
    """What `kvmesh up` was asked for."""

    model: str = "smollm2-135m"
    """Model spec every worker loads: a known name, a Hugging Face folder or a .gguf file."""
    tier: str = ""
    """Tier id clients ask for; empty derives it from the model spec."""
    mode: Mode = "colocated"
    """Colocated workers that do both prefill and decode (the default: on one machine they
    serve more tokens/s than a split pair, see BENCHMARKS.md "Peers"), or split prefill and
    decode workers."""
    prefill: int = 1
    """Prefill workers (disaggregated mode)."""
    decode: int = 1
    """Decode workers (disaggregated mode); colocated mode starts this many colocated workers."""
    engine: str = "native"
    """Engine backend of every worker: "native" (kvmesh's) or "vllm" (the kvmesh[vllm] extra:
    vLLM compiled, its threads bound to every core)."""
    gateway_port: int = GATEWAY_PORT
    """Port of the admission gateway, the stack's front door."""
    http_port: int = OPENAI_HTTP_PORT
    """Port of the gateway's OpenAI-compatible HTTP door."""
    port_offset: int = 0
    """Added to every other gRPC and metrics port, to run a second stack beside the first."""
    tenants: Path | None = None
    """Tenants file for the gateway; none serves one local tenant on 127.0.0.1."""
    redis: str = ""
    """Redis URL for the gateway's budgets and the response cache; empty: both in memory."""
    host: str = "127.0.0.1"
    """Address every service binds and is reached on."""
    state_dir: Path = field(default_factory=lambda: Path(".kvmesh"))
    """Folder for generated files (the router's pools file)."""
    log_requests: bool = False
    """The gateway logs one line per finished request."""
    worker_args: tuple[str, ...] = ()
    """Extra flags passed to every worker (e.g. a small KV budget in tests)."""
    mesh_auth: bool = True
    """Generate a mesh secret (in the state folder): the router, cache and workers then take
    calls only from the stack's own services, and KV leases and bytes are signed."""
    tls: bool = False
    """Mutual TLS on every hop: a local CA and one certificate per service in the state
    folder; the gateway serves its clients over TLS (they need the CA file)."""

    @property
    def tier_name(self) -> str:
        """The tier id: explicit, else the model's name without folders or suffix."""
        return self.tier or Path(self.model).name.removesuffix(".gguf")


@dataclass(slots=True, frozen=True)
class StackService:
    """One process of the stack."""

    name: str
    """Unique name, also the log prefix and the compose service name (e.g. "decode-0")."""
    module: str
    """Python module run with `python -m`."""
    args: tuple[str, ...]
    """Flags after the module."""
    host: str
    """Address it binds and is reached on."""
    port: int
    """gRPC port."""
    metrics_port: int
    """Prometheus port."""
    role: str = ""
    """Worker role (prefill, decode, colocated); empty for other services."""
    http_port: int | None = None
    """Port of its OpenAI-compatible HTTP door (the gateway's); None: it serves none."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables it starts with, unless the caller's environment sets them."""

    @property
    def address(self) -> str:
        """host:port for clients."""
        return f"{self.host}:{self.port}"

    @property
    def http_address(self) -> str | None:
        """host:port of its HTTP door, if it serves one."""
        return None if self.http_port is None else f"{self.host}:{self.http_port}"

    @property
    def openai_url(self) -> str | None:
        """The OpenAI API's base URL, if it serves one."""
        address = self.http_address
        return None if address is None else f"http://{address}/v1"

    def healthcheck(self, host: str = "127.0.0.1") -> list[str]:
        """The `python -m kvmesh.healthcheck` argv that probes it on `host`."""
        return ["python", "-m", "kvmesh.healthcheck", f"{host}:{self.port}"]

    def command(self, python: str) -> list[str]:
        """The argv that starts it."""
        return [python, "-m", self.module, *self.args]


def worker_service(
    options: StackOptions, role: str, index: int, slot: int, env: tuple[tuple[str, str], ...] = ()
) -> StackService:
    """The `index`-th worker of `role`, on the `slot`-th worker port, started with `env`."""
    if role not in WORKER_ROLES:
        raise ValueError(f"worker role must be one of {WORKER_ROLES}, got {role!r}")
    port = FIRST_WORKER_PORT + options.port_offset + slot
    metrics_port = FIRST_WORKER_METRICS_PORT + options.port_offset + slot
    name = f"{'worker' if role == 'colocated' else role}-{index}"
    args = (
        "--role",
        role,
        "--model",
        options.model,
        "--tier",
        options.tier_name,
        "--host",
        options.host,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--grace-s",
        str(WORKER_GRACE_S),
        *(() if options.engine == "native" else ("--engine", options.engine)),
        *mesh_args(options),
        *tls_args(options, name),
        *options.worker_args,
    )
    return StackService(
        name, "services.worker", args, options.host, port, metrics_port, role, env=env
    )


def worker_env(options: StackOptions, num_workers: int) -> tuple[tuple[str, str], ...]:
    """The environment of each of `num_workers` workers on one machine: SHARED_CORES_ENV when
    they are native and more than one (vLLM binds its own threads, VLLM_CPU_OMP_THREADS_BIND;
    a lone native worker has the cores to itself)."""
    return SHARED_CORES_ENV if options.engine == "native" and num_workers > 1 else ()


def mesh_secret_path(state_dir: Path) -> Path:
    """Where the mesh secret of the stack kept in `state_dir` lives (kvmesh up writes it,
    mode 0600)."""
    return state_dir / "secrets" / "mesh-secret"


def tls_folder(state_dir: Path) -> Path:
    """Where `kvmesh up --tls` keeps the stack's CA and certificates."""
    return state_dir / "secrets" / "tls"


def tls_args(options: StackOptions, file_name: str) -> tuple[str, ...]:
    """The TLS flags of the service whose certificate is FILE_NAME.pem (none without --tls)."""
    if not options.tls:
        return ()
    folder = tls_folder(options.state_dir)
    return (
        "--tls-cert-file",
        str(folder / f"{file_name}.pem"),
        "--tls-key-file",
        str(folder / f"{file_name}-key.pem"),
        "--tls-ca-file",
        str(folder / CA_CERT),
    )


def member_tls(state_dir: Path, file_name: str) -> TlsFiles | None:
    """The certificate `kvmesh up --tls` issued FILE_NAME in `state_dir` (None: no TLS)."""
    folder = tls_folder(state_dir)
    cert, key, ca = folder / f"{file_name}.pem", folder / f"{file_name}-key.pem", folder / CA_CERT
    if not cert.exists():
        return None
    return TlsFiles.load(cert, key, ca)


def certificate_subject(service: StackService) -> str:
    """The common name of a service's certificate: its role and mesh name."""
    if service.role:
        return certificate_name(MeshRole.WORKER, service.address)  # the address it advertises
    role = {"cache": MeshRole.CACHE, "router": MeshRole.ROUTER, "gateway": MeshRole.GATEWAY}
    return certificate_name(role[service.name], service.name)


def mesh_args(options: StackOptions) -> tuple[str, ...]:
    """The flags that make a service a member of the stack (none with mesh_auth off)."""
    if not options.mesh_auth:
        return ()
    return ("--mesh-secret-file", str(mesh_secret_path(options.state_dir)))


def plan_workers(options: StackOptions) -> list[StackService]:
    """The workers, in start order."""
    if options.mode == "colocated":
        roles = ["colocated"] * options.decode
    else:
        roles = ["prefill"] * options.prefill + ["decode"] * options.decode
    if not roles or (options.mode == "disaggregated" and not (options.prefill and options.decode)):
        raise ValueError("a stack needs at least one prefill and one decode worker (or colocated)")
    env = worker_env(options, len(roles))
    counts: dict[str, int] = {}
    workers = []
    for slot, role in enumerate(roles):
        workers.append(worker_service(options, role, counts.get(role, 0), slot, env))
        counts[role] = counts.get(role, 0) + 1
    return workers


def pools_document(options: StackOptions, workers: list[StackService]) -> dict[str, Any]:
    """The router's pools file for these workers (one tier)."""
    by_role = {role: [w.address for w in workers if w.role == role] for role in WORKER_ROLES}
    return {
        "tiers": [
            {
                "name": options.tier_name,
                "base_model": options.model,
                "quantization": "none",
                "prefill": by_role["prefill"],
                "decode": by_role["decode"],
                "colocated": by_role["colocated"],
            }
        ]
    }


def pools_path(options: StackOptions) -> Path:
    """Where the generated pools file goes."""
    return options.state_dir / "pools.yaml"


def write_pools_file(options: StackOptions, workers: list[StackService]) -> Path:
    """Writes the router's pools file and returns its path."""
    path = pools_path(options)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(pools_document(options, workers), sort_keys=False))
    return path


def plan_stack(options: StackOptions) -> list[StackService]:
    """Every process, in start order: cache, workers, router, gateway (with the OpenAI HTTP
    door)."""
    host = options.host
    offset = options.port_offset
    cache_port, cache_metrics = CACHE_PORT + offset, CACHE_METRICS_PORT + offset
    cache_args = ["--host", host, "--port", str(cache_port), "--metrics-port", str(cache_metrics)]
    if options.redis:
        cache_args += ["--redis", options.redis]
    cache_args += [*mesh_args(options), *tls_args(options, "cache")]
    cache = StackService(
        "cache", "services.cache", tuple(cache_args), host, cache_port, cache_metrics
    )
    workers = plan_workers(options)
    router_port, router_metrics = ROUTER_PORT + offset, ROUTER_METRICS_PORT + offset
    router_args = (
        "--config",
        str(pools_path(options)),
        "--host",
        host,
        "--port",
        str(router_port),
        "--metrics-port",
        str(router_metrics),
        *mesh_args(options),
        *tls_args(options, "router"),
    )
    router = StackService(
        "router", "services.router", router_args, host, router_port, router_metrics
    )
    gateway_metrics = GATEWAY_METRICS_PORT + offset
    gateway_args = [
        "--router",
        router.address,
        "--cache",
        cache.address,
        "--model-path",
        f"{options.tier_name}={options.model}",
        "--host",
        host,
        "--port",
        str(options.gateway_port),
        "--metrics-port",
        str(gateway_metrics),
        "--http-port",
        str(options.http_port),
    ]
    if options.tenants is not None:
        gateway_args += ["--tenants", str(options.tenants)]
    if options.redis:
        gateway_args += ["--redis", options.redis]
    if options.log_requests:
        gateway_args.append("--log-requests")
    gateway_args += [*mesh_args(options), *tls_args(options, "gateway")]
    gateway = StackService(
        "gateway",
        "services.admission",
        tuple(gateway_args),
        host,
        options.gateway_port,
        gateway_metrics,
        http_port=options.http_port,
    )
    return [cache, *workers, router, gateway]
