"""docker-compose.yml run for real (issue 20 point 0): `make test-compose`, not `make test`.

`make test-compose` builds the base image (mmdebstrap), the kvmesh image (deploy/Dockerfile) and
the Redis stand-in first; this module starts compose's kvmesh services and Redis under
podman-compose with deploy/compose.offline.yaml, waits until every health check passes (polled
with `podman healthcheck run`: podman runs no timers without systemd), sends requests through
the published gateway port, compares the tokens with those `kvmesh up` gives on the same
prompts, checks that one request's spans reach the Jaeger stand-in from the gateway, router and
both workers under one trace id (through the collector stand-in, as the services export them),
that every scrape target of deploy/prometheus.yml answers the Prometheus stand-in and that the
Grafana stand-in lists the kvmesh dashboard, whose every queried metric is scraped, and
stops the stack, leaving no container, volume or network behind; then the same
with deploy/compose.tls.yaml (mutual TLS on every hop, the certificates made by its tls-certs
step into a host folder, the client verifying the gateway with their CA). Each stage's time is
printed (pytest -s).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

import kvmesh
from kvmesh.healthcheck import TLS_ENV_PREFIX
from kvmesh.stack import StackOptions, plan_stack

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = ["docker-compose.yml", "deploy/compose.offline.yaml"]
MODE_FILES = {
    "plain": [],
    "tls": ["deploy/compose.tls.yaml"],
    "replicas": ["deploy/compose.replicas.yaml"],
}
"""The variants run: as it is, with mutual TLS, with every worker service as 2 replicas."""
REPLICAS = 2
PLAN = plan_stack(StackOptions(mode="disaggregated"))
OBSERVABILITY = ["otel-collector", "jaeger", "prometheus", "grafana"]
"""docker-compose.yml's observability services, as stand-ins (deploy/compose.offline.yaml,
deploy/standins/)."""
SERVICES = ["redis", *(service.name for service in PLAN), *OBSERVABILITY]
"""What the test starts after the one-shot steps: Redis, every service of `kvmesh up --mode
disaggregated` (compose's split pools) and the observability stand-ins."""
EXPORTERS_CONNECTED_WITHIN_S = 240.0
"""gRPC's reconnect backoff grows to 120 s: a service whose first exports failed may wait that
long before its next connection attempt to the collector."""
SPANS_WITHIN_S = 60.0
"""The services' span processors export every 5 s (OpenTelemetry's default); the hops' server
spans end with their calls."""
DEMO_API_KEY = "kvm_compose-demo-key"
PROMPTS = ["The quick brown fox", "Paged attention stores the KV cache in"]
MAX_TOKENS = 16
HEALTHY_WITHIN_S = 900.0
"""Model load, the engine's kernel build and warm-up in every worker, on a shared 2-core CPU."""

PODMAN_ENV = {
    **os.environ,
    "CONTAINERS_CONF": os.environ.get(
        "CONTAINERS_CONF", str(REPO_ROOT / "deploy" / "podman" / "containers.conf")
    ),
}
"""podman's settings for machines without systemd (make test-compose exports the same)."""

pytestmark = pytest.mark.timeout(1800)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def run(*argv: str, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    """Runs a command from the repository root; fails the test with its output if it fails."""
    done = subprocess.run(
        argv,
        cwd=REPO_ROOT,
        env=env or PODMAN_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, (
        f"{' '.join(argv)} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout


LISTINGS = {
    "container": ["ps", "-a", "--format", "{{.Names}}"],
    "volume": ["volume", "ls", "--format", "{{.Name}}"],
    "network": ["network", "ls", "--format", "{{.Name}}"],
}


@dataclass
class ComposeStack:
    project: str
    files: list[str]
    gateway: str
    """HOST:PORT the gateway is published on."""
    env: dict[str, str]
    ca_file: Path | None = None
    """The stack's CA with TLS (the client verifies the gateway with it)."""
    replicas: int = 1
    """Containers per worker service."""
    stages: dict[str, float] = field(default_factory=dict)
    """Seconds each stage took, printed at the end."""
    healthy_after: dict[str, float] = field(default_factory=dict)

    @property
    def one_shots(self) -> list[str]:
        """The set-up steps, run to completion before the stack: podman-compose 1.0.3 starts
        everything at once and waits for no condition."""
        return ["mesh-secret", *(["tls-certs"] if self.ca_file else [])]

    def compose(self, *args: str, timeout: float = 600) -> str:
        files = [arg for name in self.files for arg in ("-f", name)]
        return run(
            "podman-compose", "-p", self.project, *files, *args, env=self.env, timeout=timeout
        )

    def container(self, service: str, number: int = 1) -> str:
        """podman-compose's name for a service's `number`-th container."""
        return f"{self.project}_{service}_{number}"

    def containers(self) -> list[str]:
        """Every long-running container: one per service, `replicas` per worker service."""
        workers = {service.name for service in PLAN if service.role}
        return [
            self.container(service, number)
            for service in SERVICES
            for number in range(1, (self.replicas if service in workers else 1) + 1)
        ]

    def leftovers(self) -> list[str]:
        """The project's containers, volumes and networks that podman still holds."""
        label = f"label=io.podman.compose.project={self.project}"
        return [
            f"{kind} {name}"
            for kind, listing in LISTINGS.items()
            for name in run("podman", *listing, "--filter", label).split()
        ]

    def down(self) -> None:
        """Stops and removes the containers and volumes, then the network (which
        podman-compose 1.0.3's `down` leaves)."""
        self.compose("down", "-v", "-t", "45")
        label = f"label=io.podman.compose.project={self.project}"
        networks = run("podman", *LISTINGS["network"], "--filter", label).split()
        if networks:
            run("podman", "network", "rm", *networks)


def health_status(name: str) -> str:
    state = json.loads(run("podman", "inspect", "--format", "{{json .State}}", name))
    if not state.get("Running"):
        return f"not running ({state.get('Status')}, exit {state.get('ExitCode')})"
    probe = subprocess.run(
        ["podman", "healthcheck", "run", name],
        env=PODMAN_ENV,
        capture_output=True,
        text=True,
        check=False,
    )
    return "healthy" if probe.returncode == 0 else probe.stdout.strip() or probe.stderr.strip()


def one_shot_succeeded(name: str) -> bool:
    state = json.loads(run("podman", "inspect", "--format", "{{json .State}}", name))
    succeeded = state["Status"] == "exited" and state["ExitCode"] == 0
    assert succeeded, f"{name}: {state['Status']}, exit {state['ExitCode']}: {state.get('Error')}"
    return succeeded


def wait_healthy(stack: ComposeStack) -> None:
    start = time.monotonic()
    waiting = set(stack.containers())
    status: dict[str, str] = {}
    while waiting and time.monotonic() - start < HEALTHY_WITHIN_S:
        for name in sorted(waiting):
            status[name] = health_status(name)
            if status[name] == "healthy":
                stack.healthy_after[name.removeprefix(f"{stack.project}_")] = round(
                    time.monotonic() - start, 1
                )
                waiting.discard(name)
        time.sleep(2)
    if waiting:
        logs = {name: run("podman", "logs", "--tail", "30", name) for name in waiting}
        pytest.fail(f"not healthy within {HEALTHY_WITHIN_S:.0f} s: {status}\n{logs}")


@pytest.fixture(scope="module", params=list(MODE_FILES))
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ComposeStack]:
    gateway_port, http_port = free_port(), free_port()
    env = {
        **PODMAN_ENV,
        "KVMESH_GATEWAY_PORT": str(gateway_port),
        "KVMESH_HTTP_PORT": str(http_port),
    }
    files, ca_file = [*COMPOSE_FILES, *MODE_FILES[request.param]], None
    if request.param == "tls":
        tls_dir = tmp_path_factory.mktemp("compose-tls")
        env["KVMESH_TLS_DIR"] = str(tls_dir)
        ca_file = tls_dir / "ca.pem"
    replicas = REPLICAS if request.param == "replicas" else 1
    project = f"kvmesh-test-{os.getpid()}-{request.param}"
    running = ComposeStack(project, files, f"127.0.0.1:{gateway_port}", env, ca_file, replicas)
    assert not running.leftovers(), "a stack of this project is already there"
    try:
        start = time.monotonic()
        for step in running.one_shots:
            running.compose("up", "-d", step)
            run("podman", "wait", running.container(step))
            assert one_shot_succeeded(running.container(step))
        running.compose("up", "-d", *SERVICES)
        wait_healthy(running)
        running.stages["start to every service healthy"] = round(time.monotonic() - start, 1)
        yield running
    finally:
        if running.leftovers():
            running.down()
        print(f"\nkvmesh compose ({request.param}) stages (s): {running.stages}")
        print(f"kvmesh compose ({request.param}) healthy after (s): {running.healthy_after}")


@pytest.fixture(scope="module")
def expected_tokens() -> list[list[int]]:
    """The prompts' tokens from `kvmesh up` on the host."""
    return kvmesh_up_tokens()


def kvmesh_up_tokens() -> list[list[int]]:
    """The same prompts through `kvmesh up` (same plan, the default model) on the host."""
    offset = 3000 + 97 * (os.getpid() % 50)
    proc = subprocess.Popen(
        # compose's split pools (kvmesh up alone defaults to colocated workers)
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "up",
            "--mode",
            "disaggregated",
            "--port-offset",
            str(offset),
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            if "gateway ready at" in line:
                break
        assert proc.poll() is None, "kvmesh up stopped:\n" + "".join(output[-40:])
        with kvmesh.SyncClient(f"127.0.0.1:{50051 + offset}") as client:
            return [
                client.generate(p, max_tokens=MAX_TOKENS, cache_policy="bypass").token_ids
                for p in PROMPTS
            ]
    finally:
        proc.terminate()
        proc.wait(60)


def test_every_service_is_healthy(stack: ComposeStack) -> None:
    prefix = f"{stack.project}_"
    assert set(stack.healthy_after) == {name.removeprefix(prefix) for name in stack.containers()}


def fetch_in(stack: ComposeStack, service: str, url: str) -> str:
    """GET `url` from inside `service`'s container (its ports are not published)."""
    read = (
        "import sys, urllib.request as u; print(u.urlopen(sys.argv[1], timeout=10).read().decode())"
    )
    return run("podman", "exec", stack.container(service), "python", "-c", read, url)


def logs(stack: ComposeStack, service: str) -> str:
    """The last lines a service's container wrote, stdout and stderr."""
    done = subprocess.run(
        ["podman", "logs", "--tail", "20", stack.container(service)],
        env=PODMAN_ENV,
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout + done.stderr


def router_metric(stack: ComposeStack, name: str) -> dict[str, float]:
    """A router metric's samples by their `pool` label, read inside the router's container."""
    router = next(s for s in PLAN if s.name == "router")
    text = fetch_in(stack, "router", f"http://127.0.0.1:{router.metrics_port}/metrics")
    samples = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            pool = dict(part.split("=", 1) for part in labels.split(","))["pool"].strip('"')
            samples[pool] = float(value)
    return samples


def test_the_router_has_every_replica_in_rotation(stack: ComposeStack) -> None:
    """With replicas, the pools file's dns:///NAME:PORT entries stand for every container of a
    worker service: the router has them all in rotation."""
    pools = {service.role: stack.replicas for service in PLAN if service.role}

    def in_rotation() -> dict[str, float]:
        return router_metric(stack, "kvmesh:router_workers_in_rotation")

    deadline = time.monotonic() + 30
    while in_rotation() != pools and time.monotonic() < deadline:
        time.sleep(1)
    assert in_rotation() == pools


def test_the_published_gateway_answers_with_kvmesh_ups_tokens(
    stack: ComposeStack, expected_tokens: list[list[int]]
) -> None:
    start = time.monotonic()
    with kvmesh.SyncClient(stack.gateway, api_key=DEMO_API_KEY, ca_file=stack.ca_file) as client:
        results = [
            client.generate(p, max_tokens=MAX_TOKENS, cache_policy="bypass") for p in PROMPTS
        ]
    stack.stages["requests through compose"] = round(time.monotonic() - start, 1)
    assert [r.token_ids for r in results] == expected_tokens
    assert all(len(ids) > 0 for ids in expected_tokens)


def test_one_requests_spans_reach_jaeger_from_gateway_router_and_workers(
    stack: ComposeStack,
) -> None:
    """The services export their spans over OTLP to the collector stand-in, which sends them on
    to the Jaeger stand-in: the trace of one request holds the gateway's, the router's and both
    workers' spans (prefill-0 and decode-0: the KV hand-off), under one trace id. First every
    service has to have delivered a span of the requests before (a service that started before
    the collector retries with gRPC's growing reconnect backoff, dropping batches meanwhile)."""
    wanted = {"admission": {"gateway"}, "router": {"router"}, "worker": {"prefill-0", "decode-0"}}
    deadline = time.monotonic() + EXPORTERS_CONNECTED_WITHIN_S
    services = "http://127.0.0.1:16686/api/services"
    while not set(wanted) <= set(json.loads(fetch_in(stack, "jaeger", services))["data"]):
        if time.monotonic() > deadline:
            pytest.fail(
                f"spans only from {fetch_in(stack, 'jaeger', services)}; collector:\n"
                + logs(stack, "otel-collector")
                + "router:\n"
                + logs(stack, "router")
            )
        time.sleep(2)
    with kvmesh.SyncClient(stack.gateway, api_key=DEMO_API_KEY, ca_file=stack.ca_file) as client:
        result = client.generate(f"A trace of {stack.project}", max_tokens=4)
    tags = urllib.parse.quote(json.dumps({"kvmesh.request_id": result.request_id}))
    url = f"http://127.0.0.1:16686/api/traces?tags={tags}"
    deadline = time.monotonic() + SPANS_WITHIN_S
    while True:
        traces = json.loads(fetch_in(stack, "jaeger", url))["data"]
        instances: dict[str, set[str]] = {}
        for trace in traces:
            for process in trace["processes"].values():
                instance = {
                    t["value"] for t in process["tags"] if t["key"] == "service.instance.id"
                }
                instances.setdefault(process["serviceName"], set()).update(instance)
        arrived = all(wanted[name] <= instances.get(name, set()) for name in wanted)
        if arrived or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert arrived, f"spans of {result.request_id} from {instances}, want {wanted}: " + logs(
        stack, "otel-collector"
    )
    assert len(traces) == 1, f"request {result.request_id} spread over {len(traces)} traces"


def test_every_prometheus_target_answers_the_prometheus_stand_in(stack: ComposeStack) -> None:
    """The scrape targets of deploy/prometheus.yml (every kvmesh service's metrics port) are
    scraped from the Prometheus container and answer with the Prometheus text format."""
    config = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus.yml").read_text(encoding="utf-8"))
    configured = {
        target
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    deadline = time.monotonic() + 30
    while True:
        answer = json.loads(fetch_in(stack, "prometheus", "http://127.0.0.1:9090/api/v1/targets"))
        targets = {t["labels"]["instance"]: t for t in answer["data"]["activeTargets"]}
        down = {
            name: t["lastError"] or t["health"]
            for name, t in targets.items()
            if t["health"] != "up"
        }
        if not down or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert set(targets) == configured
    assert not down
    assert all(t["samples"] > 0 for t in targets.values())


EVENT_ONLY_METRICS = {"kvmesh:requests_shed_total", "kvmesh:router_retries_total"}
"""Dashboard metrics with labels that a service exports only once their event happened (a
refusal, a retry): none does on a stack that served a few requests."""
UNSCRAPED_REPLICA_METRICS = {
    "kvmesh:generation_tokens_total",
    "kvmesh:inter_token_latency_seconds_bucket",
    "kvmesh:kv_transfer_bytes_total",
}
"""With replicas, deploy/prometheus.yml's static targets name each worker service once, so
Prometheus scrapes one of its containers (the address DNS answers first), which may not have
served a request: a worker metric with labels exists only in the one that did."""


def test_grafana_lists_the_dashboard_and_prometheus_has_its_metrics(stack: ComposeStack) -> None:
    """The Grafana stand-in loaded deploy/grafana's provisioning: /api/search lists the kvmesh
    dashboard, and every metric name its panels query (the stand-in asks the provisioned
    Prometheus datasource on each /api/health) is scraped from some service after a few
    requests, but those of EVENT_ONLY_METRICS (and, with replicas, UNSCRAPED_REPLICA_METRICS)."""
    grafana = "http://127.0.0.1:3000"
    search = json.loads(fetch_in(stack, "grafana", f"{grafana}/api/search"))
    assert [(hit["uid"], hit["folderTitle"]) for hit in search] == [("kvmesh", "kvmesh")]
    with kvmesh.SyncClient(stack.gateway, api_key=DEMO_API_KEY, ca_file=stack.ca_file) as client:
        for prompt in PROMPTS:
            client.generate(prompt, max_tokens=4)
    allowed = EVENT_ONLY_METRICS | (UNSCRAPED_REPLICA_METRICS if stack.replicas > 1 else set())
    deadline = time.monotonic() + 30  # a few of Prometheus's 5 s scrape intervals
    while True:
        health = json.loads(fetch_in(stack, "grafana", f"{grafana}/api/health"))
        board = health["dashboardMetrics"]["kvmesh"]
        missing = set(board["missing"]) - allowed
        if (not missing and not board["errors"]) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert health["database"] == "ok"
    assert not board["errors"]
    assert not missing, f"the dashboard queries metrics no service exports: {sorted(missing)}"
    assert len(board["metrics"]) > len(allowed)


def test_with_tls_a_client_without_the_ca_is_refused(stack: ComposeStack) -> None:
    if stack.ca_file is None:
        pytest.skip("the plaintext stack")
    with (
        kvmesh.SyncClient(stack.gateway, api_key=DEMO_API_KEY) as client,
        pytest.raises(Exception) as raised,
    ):
        client.generate(PROMPTS[0], max_tokens=2, cache_policy="bypass", deadline_s=5)
    assert "unavailable" in str(raised.value).lower()


def probe_from(
    stack: ComposeStack, service: str, target: str, *flags: str, own_files: bool = True
) -> int:
    """The health probe of `target` run inside `service`'s container: its exit status. Without
    `own_files` the probe holds none of the TLS files the container's variables name (only
    those `flags` name)."""
    unset = [f"{TLS_ENV_PREFIX}TLS_{name}_FILE" for name in ("CERT", "KEY", "CA")]
    bare = [] if own_files else ["env", *(f"--unset={variable}" for variable in unset)]
    command = ["podman", "exec", stack.container(service), *bare, "python", "-m"]
    probe = subprocess.run(
        [*command, "kvmesh.healthcheck", target, "--timeout-s", "3", *flags],
        env=PODMAN_ENV,
        capture_output=True,
    )
    return probe.returncode


def test_with_tls_internal_ports_take_only_a_certificate_of_the_stack(
    stack: ComposeStack,
) -> None:
    """The router inside the compose network: the gateway's container reaches it with its own
    certificate (its health check's variables); a caller there holding only the CA, and a
    plaintext one, do not get through the handshake."""
    if stack.ca_file is None:
        pytest.skip("the plaintext stack")
    router = next(f"{s.name}:{s.port}" for s in PLAN if s.name == "router")
    assert probe_from(stack, "gateway", router) == 0
    ca_only = ("--tls-ca-file", "/etc/kvmesh/tls/ca.pem")
    assert probe_from(stack, "gateway", router, *ca_only, own_files=False) == 1
    assert probe_from(stack, "gateway", router, own_files=False) == 1


def test_down_leaves_nothing_behind(stack: ComposeStack) -> None:
    start = time.monotonic()
    stack.down()
    stack.stages["down"] = round(time.monotonic() - start, 1)
    assert not stack.leftovers()
