"""deploy/k8s/ runs the stack `kvmesh up` starts, and the platform can drive it.

kvmesh/stack.py is the single source, as for docker-compose.yml (test_compose.py): every
overlay, rendered with `kubectl kustomize`, must fit the Kubernetes schemas of a current release
(kubernetes-validate, offline) and run each process of `plan_stack` as a Deployment of the same
name (a worker pool named after its role), with the same module, flags, ports and probes. The
KEDA ScaledObjects must query the metric the router really exports, for the pools that exist,
and the NetworkPolicies must let through exactly the calls the services make, on their ports.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvmesh.config import ServerConfig, env_var, load_config
from kvmesh.stack import WORKER_GRACE_S, StackOptions, StackService, plan_stack, pools_document
from kvmesh.tenants import hash_key, load_tenants
from services.admission.config import AdmissionConfig
from services.cache.config import CacheConfig
from services.router import metrics as router_metrics
from services.router.config import RouterConfig
from services.router.discovery import dns_target
from services.router.scaling import ScalingPolicy
from services.router.tiers import parse_pools
from services.worker.backends import ENGINE_KINDS
from services.worker.config import WorkerConfig
from tests.unit.test_compose import DEMO_API_KEY

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S = REPO_ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "colocated", "vllm")
NAMESPACE = "kvmesh"
CONFIG_DIR = Path("/etc/kvmesh")
KUBERNETES_VERSION = kubernetes_validate.latest_version()
"""The newest release kubernetes-validate carries schemas for (1.37 today)."""

CONFIGS: dict[str, type[ServerConfig]] = {
    "services.admission": AdmissionConfig,
    "services.cache": CacheConfig,
    "services.router": RouterConfig,
    "services.worker": WorkerConfig,
}
LLM_D_ROLES = {"prefill": "prefill", "decode": "decode", "colocated": "prefill-decode"}
"""llm-d.ai/role of each worker role, so llm-d's scheduler could drive the same pods."""
MONITORING_NAMESPACE = "monitoring"
"""Where network-policy.yaml lets Prometheus scrape from."""


def options(overlay: str) -> StackOptions:
    """The `kvmesh up` options an overlay corresponds to: every interface bound, Redis for the
    gateway and the cache, the pools and tenants files mounted under /etc/kvmesh."""
    return StackOptions(
        host="0.0.0.0",
        redis="redis://redis:6379/0",
        state_dir=CONFIG_DIR,
        tenants=CONFIG_DIR / "tenants.yaml",
        mode="colocated" if overlay == "colocated" else "disaggregated",
    )


def object_name(service: StackService) -> str:
    """The Deployment and Service of a plan process: a worker's pool is named after its role
    ("prefill-0" runs in "prefill", colocated "worker-0" in "worker")."""
    return service.name.rsplit("-", 1)[0] if service.role else service.name


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    """The overlay's objects, as `kubectl kustomize` renders them."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (make test installs it with apt-get when it can)")
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert rendered.returncode == 0, rendered.stderr
    return tuple(doc for doc in yaml.safe_load_all(rendered.stdout) if doc)


def objects(overlay: str, kind: str) -> dict[str, dict[str, Any]]:
    """The overlay's objects of one kind, by name."""
    return {doc["metadata"]["name"]: doc for doc in render(overlay) if doc["kind"] == kind}


def container(deployment: Mapping[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    result: dict[str, Any] = only
    return result


def environment(deployment: Mapping[str, Any]) -> dict[str, str]:
    """The container's plain environment values (those from a fieldRef map to '')."""
    return {e["name"]: e.get("value", "") for e in container(deployment).get("env", [])}


def generated(overlay: str, kind: str, prefix: str) -> dict[str, Any]:
    """The ConfigMap or Secret kustomize generated as `prefix-<hash>`."""
    (found,) = [doc for name, doc in objects(overlay, kind).items() if name.startswith(prefix)]
    return found


def plan_cases() -> list[Any]:
    return [
        pytest.param(overlay, service, id=f"{overlay}-{service.name}")
        for overlay in OVERLAYS
        for service in plan_stack(options(overlay))
    ]


def in_cluster(overlay: str, value: str) -> str:
    """A plan argument as the manifests write it: another service's address is its Service."""
    for service in plan_stack(options(overlay)):
        if value == service.address:
            return f"{object_name(service)}:{service.port}"
    return value


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_fits_the_kubernetes_schemas(overlay: str) -> None:
    errors = []
    for doc in render(overlay):
        if doc["kind"] == "ScaledObject":
            continue  # a KEDA custom resource: checked field by field below
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {error.message}")
    assert not errors, "\n".join(errors)
    assert {doc["metadata"].get("namespace", NAMESPACE) for doc in render(overlay)} == {NAMESPACE}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_runs_the_services_of_kvmesh_up(overlay: str) -> None:
    kvmesh = {
        name
        for name, deployment in objects(overlay, "Deployment").items()
        if container(deployment).get("command", [])[:2] == ["python", "-m"]
    }
    assert kvmesh == {object_name(s) for s in plan_stack(options(overlay))}


@pytest.mark.parametrize(("overlay", "service"), plan_cases())
def test_same_module_flags_ports_and_probes(overlay: str, service: StackService) -> None:
    deployment = objects(overlay, "Deployment")[object_name(service)]
    spec = container(deployment)
    expected = ["python", "-m", service.module, *(in_cluster(overlay, a) for a in service.args)]
    assert spec["command"] == expected
    http = [] if service.http_port is None else [service.http_port]
    assert [p["containerPort"] for p in spec["ports"]] == [
        service.port,
        service.metrics_port,
        *http,
    ]
    for probe in ("startupProbe", "readinessProbe"):
        # The standard gRPC health service, the whole server ("" service).
        assert spec[probe]["grpc"] == {"port": service.port}
    liveness = spec["livenessProbe"]
    assert liveness.get("grpc", liveness.get("tcpSocket")) == {"port": service.port}
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(service.metrics_port),
    }
    ports = objects(overlay, "Service")[object_name(service)]["spec"]["ports"]
    assert [port["port"] for port in ports] == [service.port, *http]
    # Each variable the manifest sets is read by the service's config, and changes it.
    config, args = CONFIGS[service.module], spec["command"][3:]
    plain = load_config(config, args, {})
    for name, value in environment(deployment).items():
        if name != "POD_IP":
            assert load_config(config, args, {name: value}) != plain, f"{name} changes nothing"


def mounted_files(deployment: Mapping[str, Any]) -> dict[str, str]:
    """Each file the container sees from a ConfigMap or Secret: path -> 'Kind/name:key'
    (generated names without their hash suffix)."""
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"].get("volumes", [])}
    files = {}
    for mount in container(deployment).get("volumeMounts", []):
        for source in volumes[mount["name"]]["projected"]["sources"]:
            ((kind, ref),) = source.items()
            name = re.sub(r"-[a-z0-9]{10}$", "", ref["name"])
            items = ref.get("items") or [{"key": f"{name}.yaml", "path": f"{name}.yaml"}]
            for item in items:
                path = f"{mount['mountPath']}/{item['path']}"
                files[path] = f"{kind}/{name}:{item['key']}"
    return files


@pytest.mark.parametrize(("overlay", "service"), plan_cases())
def test_files_are_mounted_where_the_flags_point(overlay: str, service: StackService) -> None:
    """The pools file, the tenants file and the mesh secret (made by hand: README) each at the
    path its flag names, and nothing else."""
    flags = {"--config": "configMap/pools:pools.yaml", "--tenants": "secret/tenants:tenants.yaml"}
    flags["--mesh-secret-file"] = "secret/mesh-secret:mesh-secret"
    expected = {
        service.args[i + 1]: flags[flag] for i, flag in enumerate(service.args) if flag in flags
    }
    assert mounted_files(objects(overlay, "Deployment")[object_name(service)]) == expected


def grace_s(service: StackService, deployment: Mapping[str, Any]) -> float:
    """Seconds the service gives its in-flight calls after SIGTERM (--grace-s or env)."""
    if "--grace-s" in service.args:
        return float(service.args[service.args.index("--grace-s") + 1])
    config = CONFIGS[service.module]
    return float(environment(deployment).get(env_var(config, "grace_s"), config().grace_s))


@pytest.mark.parametrize(("overlay", "service"), plan_cases())
def test_stopping_never_cuts_a_request_in_flight(overlay: str, service: StackService) -> None:
    """preStop keeps the pod serving while it leaves the Service (and the router's DNS
    answer), then SIGTERM drains for --grace-s; the kubelet's kill comes after both."""
    deployment = objects(overlay, "Deployment")[object_name(service)]
    pod = deployment["spec"]["template"]["spec"]
    pre_stop = container(deployment)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain_s = float(pre_stop[1]) + grace_s(service, deployment)
    assert pod["terminationGracePeriodSeconds"] >= drain_s + 5
    assert grace_s(service, deployment) >= (WORKER_GRACE_S if service.role else 30)
    strategy = deployment["spec"].get("strategy", {}).get("rollingUpdate", {})
    if deployment["spec"]["replicas"] > 1:
        assert strategy["maxUnavailable"] == 0, "a rolling update must add before it removes"
        budget = objects(overlay, "PodDisruptionBudget")[object_name(service)]
        assert budget["spec"]["selector"] == deployment["spec"]["selector"]


@pytest.mark.parametrize(("overlay", "service"), plan_cases())
def test_resources_are_requested(overlay: str, service: StackService) -> None:
    resources = container(objects(overlay, "Deployment")[object_name(service)])["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert "memory" in resources["limits"]


def workers(overlay: str) -> list[StackService]:
    return [s for s in plan_stack(options(overlay)) if s.role]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_pools_are_discovered_through_their_headless_service(overlay: str) -> None:
    pools = yaml.safe_load(generated(overlay, "ConfigMap", "pools-")["data"]["pools.yaml"])
    expected = pools_document(options(overlay), workers(overlay))
    for tier in expected["tiers"]:
        for role in ("prefill", "decode", "colocated"):
            tier[role] = [
                f"dns:///{object_name(w)}:{w.port}"
                for w in workers(overlay)
                if f"{w.host}:{w.port}" in tier[role]
            ]
    assert pools == expected
    parsed = parse_pools(pools)
    for worker in workers(overlay):
        service = objects(overlay, "Service")[object_name(worker)]
        assert service["spec"]["clusterIP"] == "None"
        target = dns_target(f"dns:///{object_name(worker)}:{worker.port}")
        assert target is not None
        assert (target.host, target.port) == (object_name(worker), worker.port)
    assert parsed.tiers[0].name == options(overlay).tier_name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_advertise_their_pod_address_and_carry_both_role_labels(overlay: str) -> None:
    for worker in workers(overlay):
        deployment = objects(overlay, "Deployment")[object_name(worker)]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert labels["llm-d.ai/role"] == LLM_D_ROLES[worker.role]
        assert labels["kvmesh.io/role"] == worker.role
        env = {e["name"]: e for e in container(deployment)["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        advertise = env_var(WorkerConfig, "advertise_address")
        assert env[advertise]["value"] == f"$(POD_IP):{worker.port}"
        # The model loads before the health service answers: the startup probe waits for it.
        startup = container(deployment)["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_gpu_overlay_puts_each_worker_on_a_gpu() -> None:
    for worker in workers("gpu"):
        deployment = objects("gpu", "Deployment")[object_name(worker)]
        assert container(deployment)["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert environment(deployment)[env_var(WorkerConfig, "device")] == "cuda"
    for name, deployment in objects("gpu", "Deployment").items():
        if name not in {object_name(w) for w in workers("gpu")}:
            assert "nvidia.com/gpu" not in str(deployment), name


def test_vllm_overlay_runs_the_vllm_backend() -> None:
    for worker in workers("vllm"):
        env = environment(objects("vllm", "Deployment")[object_name(worker)])
        assert env[env_var(WorkerConfig, "engine")] == "vllm" and "vllm" in ENGINE_KINDS
        assert int(env[env_var(WorkerConfig, "block_size")]) % 32 == 0


def test_tenants_secret_holds_the_documented_demo_key(tmp_path: Path) -> None:
    secret = generated("cpu", "Secret", "tenants-")
    path = tmp_path / "tenants.yaml"
    path.write_bytes(base64.b64decode(secret["data"]["tenants.yaml"]))
    assert [t.key_sha256 for t in load_tenants(path)] == [hash_key(DEMO_API_KEY)]


QUERY = re.compile(r'^max\(([a-z_:]+)\{tier="([^"]+)", pool="([a-z]+)"\}\)$')


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_pool_scales_on_the_routers_recommendation(overlay: str) -> None:
    scaled = objects(overlay, "ScaledObject")
    pools = {object_name(w): w for w in workers(overlay)}
    assert set(scaled) == set(pools)
    router = objects(overlay, "Deployment")["router"]
    warm = int(environment(router)[env_var(RouterConfig, "scale_warm_buffer")])
    for name, scaled_object in scaled.items():
        spec = scaled_object["spec"]
        assert scaled_object["apiVersion"] == "keda.sh/v1alpha1"
        assert spec["scaleTargetRef"] == {"name": name}
        # The warm buffer is the floor: the least the router recommends, and the start size.
        assert spec["minReplicaCount"] == ScalingPolicy().min_replicas + warm
        assert objects(overlay, "Deployment")[name]["spec"]["replicas"] == spec["minReplicaCount"]
        assert spec["maxReplicaCount"] >= spec["minReplicaCount"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus"
        assert trigger["metricType"] == "AverageValue" and trigger["metadata"]["threshold"] == "1"
        match = QUERY.match(trigger["metadata"]["query"])
        assert match is not None, trigger["metadata"]["query"]
        metric, tier, pool = match.groups()
        assert metric == router_metrics.RECOMMENDED_REPLICAS._name
        assert list(router_metrics.RECOMMENDED_REPLICAS._labelnames) == ["tier", "pool"]
        role = pools[name].role
        assert (tier, pool) == (options(overlay).tier_name, role)


@dataclasses.dataclass(frozen=True)
class Peer:
    """A pod that opens a connection: its labels and namespace."""

    labels: Mapping[str, str]
    namespace: str = NAMESPACE


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for rule in selector.get("matchExpressions", []):
        key, operator, values = rule["key"], rule["operator"], rule.get("values", [])
        present = key in labels
        if not {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels.get(key) not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[operator]:
            return False
    return True


def peer_matches(rule: Mapping[str, Any], peer: Peer) -> bool:
    namespaces = rule.get("namespaceSelector")
    pods = rule.get("podSelector")
    namespace_labels = {"kubernetes.io/metadata.name": peer.namespace}
    if namespaces is None and peer.namespace != NAMESPACE:
        return False  # a podSelector alone means pods of the policy's own namespace
    if namespaces is not None and not selects(namespaces, namespace_labels):
        return False
    return pods is None or selects(pods, peer.labels)


def allowed(overlay: str, peer: Peer, target: Mapping[str, str], port: int) -> bool:
    """Whether the overlay's NetworkPolicies let `peer` open TCP `port` on a pod `target`."""
    policies = [
        p["spec"]
        for p in objects(overlay, "NetworkPolicy").values()
        if selects(p["spec"]["podSelector"], target) and "Ingress" in p["spec"]["policyTypes"]
    ]
    if not policies:
        return True
    for policy in policies:
        for rule in policy.get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            sources = rule.get("from")
            if (not ports or port in ports) and (
                sources is None or any(peer_matches(s, peer) for s in sources)
            ):
                return True
    return False


def pod_labels(overlay: str, name: str) -> dict[str, str]:
    labels: dict[str, str] = objects(overlay, "Deployment")[name]["spec"]["template"]["metadata"][
        "labels"
    ]
    return labels


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_let_through_exactly_the_mesh_calls(overlay: str) -> None:
    plan = {object_name(s): s for s in plan_stack(options(overlay))}
    pools = {object_name(w) for w in workers(overlay)}
    pods = {name: pod_labels(overlay, name) for name in [*plan, "redis"]}
    ports = {name: service.port for name, service in plan.items()} | {"redis": 6379}
    calls = {("gateway", "router"), ("gateway", "cache")}
    calls |= {("gateway", "redis"), ("cache", "redis")}
    calls |= {("router", pool) for pool in pools}
    if {"prefill", "decode"} <= pools:
        calls |= {("decode", "prefill")}  # the KV pull
    for source, target in [(s, t) for s in pods for t in pods if s != t]:
        wanted = (source, target) in calls or target == "gateway"
        got = allowed(overlay, Peer(pods[source]), pods[target], ports[target])
        assert got == wanted, f"{source} -> {target}:{ports[target]}: {got}, want {wanted}"
    outside = Peer({"app": "anything"}, namespace="default")
    for name, port in ports.items():
        assert allowed(overlay, outside, pods[name], port) == (name == "gateway")
    # The gateway's OpenAI HTTP door is a front door too, from anywhere.
    door = plan["gateway"].http_port
    assert door is not None and allowed(overlay, outside, pods["gateway"], door)
    prometheus = Peer({"app.kubernetes.io/name": "prometheus"}, namespace=MONITORING_NAMESPACE)
    for name, service in plan.items():
        assert allowed(overlay, prometheus, pods[name], service.metrics_port), name
        assert not allowed(overlay, outside, pods[name], service.metrics_port), name
