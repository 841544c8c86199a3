"""The Grafana stand-in of make test-compose (deploy/standins/grafana.py): it finds the real
provisioning and dashboard files where docker-compose.yml mounts them, takes the metric names
out of PromQL expressions, and tells the names its datasource lacks; the Prometheus stand-in
keeps the sample names it scraped. No containers."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
STANDINS = REPO_ROOT / "deploy" / "standins"


def standin(name: str) -> ModuleType:
    """A stand-in's program (a script of the stand-in images, not a package)."""
    spec = importlib.util.spec_from_file_location(f"standin_{name}", STANDINS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


grafana = standin("grafana")
prometheus = standin("prometheus")


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            "histogram_quantile(0.9, sum by (le) (rate(a:x_bucket[$__rate_interval])))",
            {"a:x_bucket"},
        ),
        ('sum by (result) (rate(hits_total{service="cache", by="on"}[5m]))', {"hits_total"}),
        ("sum(rate(x_total[1m])) by (le) / ignoring(code) group_left(job) y", {"x_total", "y"}),
        ("max without (instance) (up offset 5m) > bool 0.5 and on() z", {"up", "z"}),
        ('topk(3, requests{path=~"/api/{x}"}) * 3600 unless Inf', {"requests"}),
        ("count(count by (pool) (workers)) or vector(0)", {"workers"}),
        ('label_replace(m, "dst", "$1", "src", "(.*)")', {"m"}),
    ],
)
def test_metric_names_are_the_identifiers_that_select_series(expr: str, names: set[str]) -> None:
    assert grafana.metric_names(expr) == names


@pytest.fixture(scope="module")
def container_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """docker-compose.yml's mounts of the grafana service, laid out under a folder."""
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    root = tmp_path_factory.mktemp("grafana-root")
    for volume in compose["services"]["grafana"]["volumes"]:
        source, target, _ = volume.split(":")
        mount = root / target.lstrip("/")
        mount.parent.mkdir(parents=True, exist_ok=True)
        mount.symlink_to(REPO_ROOT / source)
    return root


def test_the_provisioned_datasource_is_composes_prometheus(container_root: Path) -> None:
    provisioning = container_root / "etc" / "grafana" / "provisioning"
    [source] = grafana.load_datasources(provisioning)
    assert (source.uid, source.type, source.url, source.default) == (
        "prometheus",
        "prometheus",
        "http://prometheus:9090",
        True,
    )


def test_the_kvmesh_dashboard_is_provisioned_with_every_panels_query(
    container_root: Path,
) -> None:
    provisioning = container_root / "etc" / "grafana" / "provisioning"
    [board] = grafana.load_dashboards(provisioning, root=container_root)
    assert (board.uid, board.title, board.folder) == ("kvmesh", "kvmesh", "kvmesh")
    raw = json.loads((REPO_ROOT / "deploy/grafana/dashboards/kvmesh.json").read_text("utf-8"))
    exprs = [t["expr"] for p in raw["panels"] for t in p.get("targets", []) if t.get("expr")]
    assert [expr for panel in board.panels for expr in panel.exprs] == exprs
    assert {panel.datasource_uid for panel in board.panels} == {"prometheus"}
    # The tokenizer finds every kvmesh name in the expressions, and nothing else.
    found = {name for expr in exprs for name in grafana.metric_names(expr)}
    assert found == {name for expr in exprs for name in KVMESH_NAME.findall(expr)}


KVMESH_NAME = re.compile(r"kvmesh:[a-z0-9_:]+")
"""The dashboard's metric names by their prefix, independently of the tokenizer."""


class FakePrometheus(BaseHTTPRequestHandler):
    """Answers the label values API with `names`, and serves `exposition` as /metrics."""

    names: ClassVar[list[str]] = []
    exposition: ClassVar[bytes] = b""

    def do_GET(self) -> None:
        if self.path == "/api/v1/label/__name__/values":
            data = json.dumps({"status": "success", "data": self.names}).encode()
        else:
            data = self.exposition
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture
def fake_prometheus() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakePrometheus)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_health_names_the_dashboards_metrics_the_datasource_lacks(
    container_root: Path, fake_prometheus: str
) -> None:
    provisioning = container_root / "etc" / "grafana" / "provisioning"
    boards = grafana.load_dashboards(provisioning, root=container_root)
    used = sorted({n for p in boards[0].panels for e in p.exprs for n in grafana.metric_names(e)})
    FakePrometheus.names = used[1:]
    [source] = grafana.load_datasources(provisioning)
    source.url = f"http://{fake_prometheus}/"
    report = grafana.dashboard_metrics(boards, [source])
    assert report == {"kvmesh": {"metrics": used, "missing": used[:1], "errors": []}}


def test_health_says_when_the_datasource_cannot_be_asked(container_root: Path) -> None:
    provisioning = container_root / "etc" / "grafana" / "provisioning"
    boards = grafana.load_dashboards(provisioning, root=container_root)
    [source] = grafana.load_datasources(provisioning)
    source.url = "http://127.0.0.1:1"  # nothing listens on port 1
    [errors] = grafana.dashboard_metrics(boards, [source])["kvmesh"]["errors"]
    assert errors.startswith("http://127.0.0.1:1: URLError")


def test_the_prometheus_standin_keeps_the_sample_names_of_its_last_scrape(
    fake_prometheus: str,
) -> None:
    FakePrometheus.exposition = (
        b"# TYPE jobs counter\njobs_total 3\n"
        b'# TYPE wait histogram\nwait_bucket{le="+Inf"} 1\nwait_sum 0.5\nwait_count 1\n'
    )
    target = prometheus.Target(
        job="kvmesh",
        address=fake_prometheus,
        labels={},
        url=f"http://{fake_prometheus}/metrics",
        interval_s=5.0,
    )
    target.scrape()
    assert target.health == "up"
    assert target.names == {"jobs_total", "wait_bucket", "wait_sum", "wait_count"}
