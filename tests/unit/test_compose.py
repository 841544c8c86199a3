"""docker-compose.yml and deploy/ describe the same stack that `kvmesh up` starts.

kvmesh/stack.py is the single source: every process of `plan_stack` must appear in compose
under the same name, running the same module with the same flags and ports, and the router's
pools file must hold the same tiers and workers. Addresses differ only in their host part:
in containers a service is reached by its compose service name.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

from kvmesh.compose_certs import compose_certificates
from kvmesh.config import ServerConfig, env_var
from kvmesh.stack import (
    StackOptions,
    StackService,
    mesh_secret_path,
    plan_stack,
    plan_workers,
    pools_document,
    pools_path,
    tls_folder,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DEPLOY = REPO_ROOT / "deploy"

CONFIG_DIR = Path("/etc/kvmesh")
COMPOSE_OPTIONS = StackOptions(
    mode="disaggregated",
    host="0.0.0.0",
    redis="redis://redis:6379/0",
    state_dir=CONFIG_DIR,
    tenants=CONFIG_DIR / "tenants.yaml",
)
"""The `kvmesh up` options compose corresponds to: split prefill and decode workers (compose's
own default, unlike `kvmesh up`'s colocated one), bind every interface, Redis for the gateway
and the cache, config files mounted under /etc/kvmesh (a gateway without a tenants file
listens on 127.0.0.1 only, out of reach from other containers)."""

PLAN = plan_stack(COMPOSE_OPTIONS)
WORKERS = [service for service in PLAN if service.role]
OTLP_ENDPOINT = "http://otel-collector:4317"
DEMO_API_KEY = "kvm_compose-demo-key"
"""The demo tenant's key, as README.md and deploy/tenants.yaml document it."""


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    services: dict[str, Any] = document["services"]
    return services


def in_compose(value: str) -> str:
    """A plan argument as compose writes it: another service's address becomes name:port."""
    for service in PLAN:
        if value == service.address:
            return f"{service.name}:{service.port}"
    return value


def expected_command(service: StackService) -> list[str]:
    return ["python", "-m", service.module, *(in_compose(arg) for arg in service.args)]


def compose_spec_schema() -> dict[str, Any]:
    """The Compose Specification's JSON schema, as check-jsonschema vendors it (a dev dependency:
    no docker-compose program is needed to validate the file)."""
    vendored = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema: dict[str, Any] = json.loads(vendored.read_text(encoding="utf-8"))
    return schema


def active_services(services: dict[str, Any], profile: str) -> dict[str, Any]:
    """The services `docker-compose --profile PROFILE up` starts: those without profiles, and
    those that list PROFILE."""
    return {
        name: service
        for name, service in services.items()
        if not service.get("profiles") or profile in service["profiles"]
    }


def test_compose_file_fits_the_compose_spec() -> None:
    document = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    validator = jsonschema.Draft202012Validator(compose_spec_schema())
    errors = [
        f"{'/'.join(str(part) for part in error.absolute_path) or '(top)'}: {error.message}"
        for error in validator.iter_errors(document)
    ]
    assert not errors, "docker-compose.yml breaks the Compose Specification:\n" + "\n".join(errors)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_every_dependency_runs_in_the_profile(compose: dict[str, Any], profile: str) -> None:
    """A dependency on a service outside the active profiles is an error when compose starts."""
    running = active_services(compose, profile)
    for name, service in running.items():
        depends_on = service.get("depends_on") or {}
        for dependency in depends_on:
            assert dependency in running, f"{name} depends on {dependency}, not in {profile}"


def test_compose_runs_the_services_of_kvmesh_up(compose: dict[str, Any]) -> None:
    """Those of `kvmesh up --mode disaggregated`: compose keeps split prefill and decode pools
    (its containers may run on several machines), where `kvmesh up` defaults to colocated."""
    kvmesh_services = {
        name
        for name, spec in compose.items()
        if spec.get("command", [])[:2] == ["python", "-m"]
        and "gpu" not in spec.get("profiles", [])
        and not one_shot(spec)
    }
    assert kvmesh_services == {service.name for service in PLAN}


@pytest.mark.parametrize("service", PLAN, ids=lambda s: s.name)
def test_same_module_flags_and_ports(compose: dict[str, Any], service: StackService) -> None:
    spec = compose[service.name]
    assert spec["command"] == expected_command(service)
    http = [] if service.http_port is None else [str(service.http_port)]
    assert spec["expose"] == [str(service.port), str(service.metrics_port), *http]
    # One command line (CMD-SHELL): see docker-compose.yml's x-health.
    assert spec["healthcheck"]["test"] == shlex.join(service.healthcheck())
    assert spec["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == OTLP_ENDPOINT
    # The environment the plan starts it with (kvmesh up's), e.g. the workers' passive wait.
    assert spec["environment"].items() >= dict(service.env).items()


def test_gateway_and_its_openai_door_are_published_on_their_ports(compose: dict[str, Any]) -> None:
    """On kvmesh up's ports unless KVMESH_GATEWAY_PORT / KVMESH_HTTP_PORT name others."""
    gateway = next(service for service in PLAN if service.name == "gateway")
    grpc = f"${{KVMESH_GATEWAY_PORT:-{COMPOSE_OPTIONS.gateway_port}}}"
    http = f"${{KVMESH_HTTP_PORT:-{COMPOSE_OPTIONS.http_port}}}"
    assert compose[gateway.name]["ports"] == [
        f"127.0.0.1:{grpc}:{gateway.port}",
        f"127.0.0.1:{http}:{gateway.http_port}",
    ]


def test_the_offline_override_names_real_services_and_overrides_no_list(
    compose: dict[str, Any],
) -> None:
    """deploy/compose.offline.yaml (make test-compose): podman-compose 1.0.3 appends an
    override's lists to the file's own where docker compose replaces them, so it may set only
    mappings and single values; the kvmesh services are left as they are (they export spans
    to the collector stand-in), the observability images are replaced by the stand-ins'
    targets of deploy/standins/Dockerfile, and a health check is added only where the file has
    none (podman-compose would merge two)."""
    override = yaml.safe_load((DEPLOY / "compose.offline.yaml").read_text(encoding="utf-8"))

    def lists_in(value: Any, path: str) -> list[str]:
        if isinstance(value, list):
            return [path]
        if isinstance(value, dict):
            return [p for key, inner in value.items() for p in lists_in(inner, f"{path}/{key}")]
        return []

    assert not list(jsonschema.Draft202012Validator(compose_spec_schema()).iter_errors(override))
    assert set(override["services"]) <= set(compose)
    assert lists_in(override["services"], "services") == []
    assert not {service.name for service in PLAN} & set(override["services"])
    assert override["services"]["redis"]["build"]["dockerfile"] == "deploy/redis.Dockerfile"
    for name in ("otel-collector", "jaeger", "prometheus", "grafana"):
        standin = override["services"][name]
        assert standin["build"]["dockerfile"] == "deploy/standins/Dockerfile"
        assert standin["build"]["target"] == name
        assert standin["image"] == f"kvmesh-{name}:local"
        assert "healthcheck" not in standin or "healthcheck" not in compose[name]


def test_config_files_are_mounted_where_the_flags_point(compose: dict[str, Any]) -> None:
    assert f"./deploy/pools.yaml:{pools_path(COMPOSE_OPTIONS)}:ro" in compose["router"]["volumes"]
    tenants_mounts = [v for v in compose["gateway"]["volumes"] if v.endswith("tenants.yaml:ro")]
    assert tenants_mounts == [
        f"${{KVMESH_TENANTS_FILE:-./deploy/tenants.yaml}}:{COMPOSE_OPTIONS.tenants}:ro"
    ]


@pytest.mark.parametrize("service", PLAN, ids=lambda s: s.name)
def test_the_mesh_secret_is_made_once_and_mounted_where_the_flag_points(
    compose: dict[str, Any], service: StackService
) -> None:
    secret = mesh_secret_path(COMPOSE_OPTIONS.state_dir)
    maker = compose["mesh-secret"]
    assert maker["command"] == ["python", "-m", "kvmesh.mesh_keys", str(secret)]
    assert maker["volumes"] == [f"mesh-secrets:{secret.parent}"]
    spec = compose[service.name]
    assert f"mesh-secrets:{secret.parent}:ro" in spec["volumes"]
    assert spec["depends_on"]["mesh-secret"] == {"condition": "service_completed_successfully"}


def test_pools_file_matches_the_plan() -> None:
    expected = pools_document(COMPOSE_OPTIONS, plan_workers(COMPOSE_OPTIONS))
    for tier in expected["tiers"]:
        for role in ("prefill", "decode", "colocated"):
            tier[role] = [in_compose(address) for address in tier[role]]
    assert yaml.safe_load((DEPLOY / "pools.yaml").read_text(encoding="utf-8")) == expected


def test_demo_tenant_file_holds_the_documented_key() -> None:
    from kvmesh.tenants import hash_key, load_tenants

    tenants = load_tenants(DEPLOY / "tenants.yaml")
    assert [t.key_sha256 for t in tenants] == [hash_key(DEMO_API_KEY)]


def one_shot(spec: dict[str, Any]) -> bool:
    """A set-up step that runs once and exits (restart: "no")."""
    return bool(spec.get("restart") == "no")


def test_dependencies_wait_for_health(compose: dict[str, Any]) -> None:
    for name, spec in compose.items():
        for target, rule in spec.get("depends_on", {}).items():
            wanted = "service_healthy" if "healthcheck" in compose[target] else "service_started"
            if one_shot(compose[target]):
                wanted = "service_completed_successfully"
            assert rule == {"condition": wanted}, f"{name} -> {target}"
    assert set(compose["gateway"]["depends_on"]) >= {"redis", "cache", "router"}
    assert set(compose["cache"]["depends_on"]) >= {"redis"}


@pytest.mark.parametrize("worker", WORKERS, ids=lambda s: s.name)
def test_workers_run_on_cpu_or_reserve_a_gpu(compose: dict[str, Any], worker: StackService) -> None:
    cpu, gpu = compose[worker.name], compose[f"{worker.name}-gpu"]
    assert cpu["profiles"] == ["cpu"]
    assert "deploy" not in cpu
    assert gpu["profiles"] == ["gpu"]
    assert gpu["command"] == cpu["command"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    assert gpu["environment"] == {**cpu["environment"], "KVMESH_WORKER_DEVICE": "cuda"}
    # Both answer to the plan's name, which the pools file and Prometheus use: the CPU variant
    # is named so, the GPU variant has it as an alias (only there: podman-compose 1.0.3 cannot
    # start a service whose networks are a mapping).
    assert "networks" not in cpu
    assert gpu["networks"]["default"]["aliases"] == [worker.name]
    for variant in (cpu, gpu):
        advertised = variant["environment"]["KVMESH_WORKER_ADVERTISE_ADDRESS"]
        assert advertised == f"{worker.name}:{worker.port}"


def test_plain_up_selects_the_cpu_profile(compose: dict[str, Any]) -> None:
    settings = dict(
        line.split("=", 1)
        for line in (REPO_ROOT / ".env").read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#")
    )
    assert settings["COMPOSE_PROFILES"] == "cpu"
    workers = {name for name, spec in compose.items() if spec.get("profiles")}
    for name, spec in compose.items():
        # A dependency outside the active profiles is an error, so nothing may wait on a worker.
        assert not workers & set(spec.get("depends_on", {})), name


def test_prometheus_scrapes_every_metrics_port() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text(encoding="utf-8"))
    scraped = {
        (target, group["labels"]["service"])
        for job in config["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    assert scraped == {(f"{s.name}:{s.metrics_port}", s.name) for s in PLAN}


METRIC_NAME = re.compile(r"kvmesh:[a-z0-9_:]+")
EXPOSITION_SUFFIX = re.compile(r"_(total|bucket|sum|count)$")


def defined_metrics() -> set[str]:
    """Every `kvmesh:` metric name a prometheus_client metric is declared with in the code."""
    literal = re.compile(r"[\"'](kvmesh:[a-z0-9_:]+)[\"']")
    sources = [*(REPO_ROOT / "kvmesh").rglob("*.py"), *(REPO_ROOT / "services").rglob("*.py")]
    return {
        EXPOSITION_SUFFIX.sub("", name)
        for path in sources
        for name in literal.findall(path.read_text(encoding="utf-8"))
    }


def test_dashboard_queries_metrics_the_services_export() -> None:
    dashboard = (DEPLOY / "grafana" / "dashboards" / "kvmesh.json").read_text(encoding="utf-8")
    queried = {EXPOSITION_SUFFIX.sub("", name) for name in METRIC_NAME.findall(dashboard)}
    assert queried <= defined_metrics(), queried - defined_metrics()
    # TTFT, ITL, tokens/s, KV usage, queue depth, shed rate, cost per tenant.
    assert queried >= {
        "kvmesh:time_to_first_token_seconds",
        "kvmesh:inter_token_latency_seconds",
        "kvmesh:generation_tokens",
        "kvmesh:kv_cache_usage_perc",
        "kvmesh:num_requests_waiting",
        "kvmesh:requests_shed",
        "kvmesh:tenant_cost_usd",
    }


def test_only_the_front_doors_and_dashboards_are_published_and_on_loopback(
    compose: dict[str, Any],
) -> None:
    """Internal gRPC and metrics ports stay on the compose network (expose, never ports);
    what is published binds the host's 127.0.0.1 only (issue 15.4)."""
    published = {name: spec["ports"] for name, spec in compose.items() if spec.get("ports")}
    assert set(published) == {"gateway", "jaeger", "prometheus", "grafana"}
    for name, ports in published.items():
        assert all(str(port).startswith("127.0.0.1:") for port in ports), name


TLS_OPTIONS = replace(COMPOSE_OPTIONS, tls=True)
TLS_PLAN = plan_stack(TLS_OPTIONS)
COMPOSE_TLS_DIR = Path("/etc/kvmesh/tls")
"""Where deploy/compose.tls.yaml mounts the host's TLS folder; kvmesh up's is tls_folder()."""


@pytest.fixture(scope="module")
def tls_override() -> dict[str, Any]:
    document = yaml.safe_load((DEPLOY / "compose.tls.yaml").read_text(encoding="utf-8"))
    services: dict[str, Any] = document["services"]
    return services


def config_class(module: str) -> type[ServerConfig]:
    """The typed config class of a service module (services.cache -> CacheConfig)."""
    config = importlib.import_module(f"{module}.config")
    [found] = [
        value
        for value in vars(config).values()
        if isinstance(value, type) and issubclass(value, ServerConfig) and value is not ServerConfig
    ]
    return found


def tls_environment(service: StackService) -> dict[str, str]:
    """kvmesh up --tls's TLS flags of `service` as the variables that set them, pointing into
    the folder compose mounts."""
    args = service.args
    flags = {arg: args[i + 1] for i, arg in enumerate(args) if arg.startswith("--tls-")}
    folder = tls_folder(TLS_OPTIONS.state_dir)
    return {
        env_var(config_class(service.module), flag[2:].replace("-", "_")): str(
            COMPOSE_TLS_DIR / Path(path).relative_to(folder)
        )
        for flag, path in flags.items()
    }


@pytest.mark.parametrize("service", TLS_PLAN, ids=lambda s: s.name)
def test_the_tls_override_gives_each_service_kvmesh_up_tls_files(
    compose: dict[str, Any], tls_override: dict[str, Any], service: StackService
) -> None:
    """deploy/compose.tls.yaml sets, for every service, the TLS files kvmesh up --tls passes
    (by their variables, which docker compose and podman-compose merge alike), mounts the
    folder read-only, waits for the tls-certs step and points the health check at the
    service's own certificate."""
    expected = tls_environment(service)
    assert expected, f"kvmesh up --tls gives {service.name} no TLS flag"
    for name in names_of(service):
        override = tls_override[name]
        assert name in compose
        probe = {
            key.replace(env_var(config_class(service.module), ""), "KVMESH_HEALTHCHECK_"): value
            for key, value in expected.items()
        }
        assert override["environment"] == {**expected, **probe}, name
        assert override["volumes"] == [
            f"${{KVMESH_TLS_DIR:-./.kvmesh/compose-tls}}:{COMPOSE_TLS_DIR}:ro"
        ]
        assert override["depends_on"] == {
            "tls-certs": {"condition": "service_completed_successfully"}
        }
    assert set(tls_override) == {"tls-certs", *(n for s in TLS_PLAN for n in names_of(s))}

    assert not list(
        jsonschema.Draft202012Validator(compose_spec_schema()).iter_errors(
            {"services": tls_override}
        )
    )


def test_tls_adds_only_the_tls_flags_so_compose_commands_stay_as_they_are() -> None:
    """With TLS compose runs the same commands (set by test_same_module_flags_and_ports): kvmesh
    up --tls differs only by the --tls-* flags the override sets through variables."""
    for plain, tls in zip(PLAN, TLS_PLAN, strict=True):
        args = list(tls.args)
        for flag in [a for a in args if a.startswith("--tls-")]:
            del args[args.index(flag) : args.index(flag) + 2]
        assert (tls.name, tuple(args)) == (plain.name, plain.args)


def names_of(service: StackService) -> list[str]:
    """A service's compose names: a worker has its GPU variant too."""
    return [service.name] + ([f"{service.name}-gpu"] if service.role else [])


def test_the_tls_certs_step_issues_every_file_the_services_read(
    tls_override: dict[str, Any], tmp_path: Path
) -> None:
    step = tls_override["tls-certs"]
    assert step["command"] == [
        "python",
        "-m",
        "kvmesh.compose_certs",
        str(COMPOSE_TLS_DIR),
        "--owner",
        "10001",
    ]
    assert step["volumes"] == [f"${{KVMESH_TLS_DIR:-./.kvmesh/compose-tls}}:{COMPOSE_TLS_DIR}"]
    assert one_shot(step)
    issued = compose_certificates(tmp_path)
    read = {
        Path(value).name
        for spec in tls_override.values()
        for value in spec.get("environment", {}).values()
    }
    assert read <= {path.name for path in tmp_path.iterdir()}
    for service in TLS_PLAN:
        cert = x509.load_pem_x509_certificate((tmp_path / f"{service.name}.pem").read_bytes())
        [common_name] = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        in_compose = f"{service.name}:{service.port}" if service.role else service.name
        role = "worker" if service.role else service.name
        assert common_name.value == f"{role}:{in_compose}"
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert service.name in names.get_values_for_type(x509.DNSName)
    assert "operator" in issued
    assert compose_certificates(tmp_path) == []  # kept: a restarted stack keeps its files


def test_the_replicas_pools_name_every_worker_service_in_the_dns_form() -> None:
    """deploy/pools.replicas.yaml is deploy/pools.yaml with each worker as dns:///NAME:PORT,
    which the router's discovery resolves to every replica (services/router/discovery.py)."""
    expected = pools_document(COMPOSE_OPTIONS, plan_workers(COMPOSE_OPTIONS))
    for tier in expected["tiers"]:
        for role in ("prefill", "decode", "colocated"):
            tier[role] = [f"dns:///{in_compose(address)}" for address in tier[role]]
    replicas = yaml.safe_load((DEPLOY / "pools.replicas.yaml").read_text(encoding="utf-8"))
    assert replicas == expected


def test_the_replicas_override_scales_every_worker_and_mounts_those_pools(
    compose: dict[str, Any],
) -> None:
    override = yaml.safe_load((DEPLOY / "compose.replicas.yaml").read_text(encoding="utf-8"))
    services = override["services"]
    assert set(services) == {worker.name for worker in WORKERS} | {"router"}
    for worker in WORKERS:
        assert services[worker.name]["deploy"]["replicas"] >= 2
        # No host: each replica advertises its own container's IP (services/worker).
        advertised = services[worker.name]["environment"]["KVMESH_WORKER_ADVERTISE_ADDRESS"]
        assert advertised == f":{worker.port}"
        assert "deploy" not in compose[worker.name]
    assert services["router"]["volumes"] == [
        f"./deploy/pools.replicas.yaml:{pools_path(COMPOSE_OPTIONS)}:ro"
    ]
    assert not list(jsonschema.Draft202012Validator(compose_spec_schema()).iter_errors(override))
