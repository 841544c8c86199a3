"""docker-compose.yml run for real (issue 20 point 0): `make test-compose`, not `make test`.

`make test-compose` builds the base image (mmdebstrap), the kvmesh image (deploy/Dockerfile) and
the Redis stand-in first; this module starts compose's kvmesh services and Redis under
podman-compose with deploy/compose.offline.yaml, waits until every health check passes (polled
with `podman healthcheck run`: podman runs no timers without systemd), sends requests through
the published gateway port, compares the tokens with those `kvmesh up` gives on the same
prompts, and stops the stack, leaving no container, volume or network behind. Each stage's time
is printed (pytest -s).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import kvmesh
from kvmesh.stack import StackOptions, plan_stack

REPO_ROOT = Path(__file__).resolve().parents[2]
PROJECT = f"kvmesh-test-{os.getpid()}"
COMPOSE = [
    "podman-compose",
    "-p",
    PROJECT,
    "-f",
    "docker-compose.yml",
    "-f",
    "deploy/compose.offline.yaml",
]
PLAN = plan_stack(StackOptions())
SERVICES = ["redis", "mesh-secret", *(service.name for service in PLAN)]
"""What the test starts: Redis, the one-shot mesh-secret step and every service of kvmesh up
(the observability services are images from a registry, out of reach here)."""
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


def container(service: str) -> str:
    """podman-compose's name for a service's (first) container."""
    return f"{PROJECT}_{service}_1"


def leftovers() -> list[str]:
    """The project's containers, volumes and networks that podman still holds."""
    return [
        f"{kind} {name}"
        for kind, listing in LISTINGS.items()
        for name in run("podman", *listing, "--filter", PROJECT_LABEL).split()
    ]


PROJECT_LABEL = f"label=io.podman.compose.project={PROJECT}"
LISTINGS = {
    "container": ["ps", "-a", "--format", "{{.Names}}"],
    "volume": ["volume", "ls", "--format", "{{.Name}}"],
    "network": ["network", "ls", "--format", "{{.Name}}"],
}


@dataclass
class ComposeStack:
    gateway: str
    """HOST:PORT the gateway is published on."""
    env: dict[str, str]
    stages: dict[str, float] = field(default_factory=dict)
    """Seconds each stage took, printed at the end."""
    healthy_after: dict[str, float] = field(default_factory=dict)

    def compose(self, *args: str, timeout: float = 600) -> str:
        return run(*COMPOSE, *args, env=self.env, timeout=timeout)

    def down(self) -> None:
        """Stops and removes the containers and volumes, then the network (which
        podman-compose 1.0.3's `down` leaves)."""
        self.compose("down", "-v", "-t", "45")
        networks = run("podman", *LISTINGS["network"], "--filter", PROJECT_LABEL).split()
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


def wait_healthy(stack: ComposeStack, services: list[str]) -> None:
    start = time.monotonic()
    waiting = set(services)
    status: dict[str, str] = {}
    while waiting and time.monotonic() - start < HEALTHY_WITHIN_S:
        for service in sorted(waiting):
            status[service] = health_status(container(service))
            if status[service] == "healthy":
                stack.healthy_after[service] = round(time.monotonic() - start, 1)
                waiting.discard(service)
        time.sleep(2)
    if waiting:
        logs = {s: run("podman", "logs", "--tail", "30", container(s)) for s in waiting}
        pytest.fail(f"not healthy within {HEALTHY_WITHIN_S:.0f} s: {status}\n{logs}")


@pytest.fixture(scope="module")
def stack() -> Iterator[ComposeStack]:
    gateway_port, http_port = free_port(), free_port()
    env = {
        **PODMAN_ENV,
        "KVMESH_GATEWAY_PORT": str(gateway_port),
        "KVMESH_HTTP_PORT": str(http_port),
    }
    running = ComposeStack(f"127.0.0.1:{gateway_port}", env)
    assert not leftovers(), "a stack of this project is already there"
    try:
        start = time.monotonic()
        # The one-shot secret step first: podman-compose 1.0.3 starts everything at once and
        # does not wait for conditions.
        running.compose("up", "-d", "mesh-secret")
        run("podman", "wait", container("mesh-secret"))
        assert one_shot_succeeded(container("mesh-secret"))
        running.compose("up", "-d", *SERVICES)
        long_running = [s for s in SERVICES if s != "mesh-secret"]
        wait_healthy(running, long_running)
        running.stages["start to every service healthy"] = round(time.monotonic() - start, 1)
        yield running
    finally:
        if leftovers():
            running.down()
        print(f"\nkvmesh compose stages (s): {running.stages}")
        print(f"kvmesh compose services healthy after (s): {running.healthy_after}")


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
    assert set(stack.healthy_after) == set(SERVICES) - {"mesh-secret"}


def test_the_published_gateway_answers_with_kvmesh_ups_tokens(stack: ComposeStack) -> None:
    start = time.monotonic()
    with kvmesh.SyncClient(stack.gateway, api_key=DEMO_API_KEY) as client:
        results = [
            client.generate(p, max_tokens=MAX_TOKENS, cache_policy="bypass") for p in PROMPTS
        ]
    stack.stages["requests through compose"] = round(time.monotonic() - start, 1)
    start = time.monotonic()
    expected = kvmesh_up_tokens()
    stack.stages["kvmesh up, same prompts"] = round(time.monotonic() - start, 1)
    assert [r.token_ids for r in results] == expected
    assert all(len(ids) > 0 for ids in expected)


def test_down_leaves_nothing_behind(stack: ComposeStack) -> None:
    start = time.monotonic()
    stack.down()
    stack.stages["down"] = round(time.monotonic() - start, 1)
    assert not leftovers()
