"""A stand-in for Grafana in docker-compose.yml, for machines that reach no container registry
(make test-compose). Test infrastructure: it draws nothing and has no users or database.

It reads what the real image reads from its mounts: the provisioning folder
($GF_PATHS_PROVISIONING, default /etc/grafana/provisioning): datasources/*.yaml (name, uid,
type, url, isDefault) and dashboards/*.yaml (each `file` provider's folder and options.path),
and every dashboard JSON under a provider's path (uid, title, tags, panels and the rows' panels,
each target's datasource and expr). It listens on $GF_SERVER_HTTP_ADDR:$GF_SERVER_HTTP_PORT
(default 0.0.0.0:3000) and answers:
  GET /api/health     Grafana's health answer ("database": "ok" once provisioning loaded), plus
                      "dashboardMetrics" (not in Grafana's answer): per dashboard, the metric
                      names its panels' PromQL expressions use and those its Prometheus
                      datasource does not have (asked on every call, at URL
                      /api/v1/label/__name__/values): a panel that would show "No data"
  GET /api/search     the provisioned dashboards (?query= filters on the title), in the shape
                      of Grafana's search API

PromQL is not parsed: metric names are taken from the expressions by a tokenizer that drops
strings, label matchers {...}, ranges [...], grouping label lists (by, without, on, ignoring,
group_left, group_right), Grafana variables ($name), numbers, keywords, aggregation operators
and function names (an identifier followed by "("); what is left are the metric names.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

VERSION = "11.5.2"  # the image docker-compose.yml names
QUERY_TIMEOUT_S = 3.0

TOKEN = re.compile(
    r"""(?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
      |(?P<variable>\$\{[^}]*\}|\$\w+)
      |(?P<number>\.?\d[\w.]*)
      |(?P<name>[A-Za-z_:][\w:]*)
      |(?P<space>\s+)
      |(?P<other>.)""",
    re.VERBOSE,
)
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
"""Keywords followed by a label list, not by an expression."""
AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count"}
"""Aggregation operators that may come without "(" next (`sum by (le) (...)`); those that take
a parameter (topk, quantile, ...) always have "(" next."""
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2", *AGGREGATIONS}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (see the module's docstring)."""
    tokens = [
        (match.lastgroup, match.group())
        for match in TOKEN.finditer(expr)
        if match.lastgroup != "space"
    ]
    names: set[str] = set()
    nesting = 0  # inside {...} or [...]
    skip_list = False  # a grouping keyword's (label, ...) comes next
    index = 0
    while index < len(tokens):
        kind, text = tokens[index]
        following = tokens[index + 1][1] if index + 1 < len(tokens) else ""
        if kind == "other" and text in "{[":
            nesting += 1
        elif kind == "other" and text in "}]":
            nesting -= 1
        elif kind == "other" and text == "(" and skip_list:
            while index < len(tokens) and tokens[index][1] != ")":
                index += 1
        elif kind == "name" and nesting == 0:
            if text.lower() in GROUPING:
                skip_list = True
                index += 1
                continue
            if text.lower() not in KEYWORDS and following != "(":
                names.add(text)
        skip_list = False
        index += 1
    return names


@dataclass(slots=True)
class Datasource:
    name: str
    uid: str
    type: str
    url: str
    default: bool


@dataclass(slots=True)
class Panel:
    title: str
    datasource_uid: str | None
    """None: the default datasource."""
    exprs: list[str]


@dataclass(slots=True)
class Dashboard:
    uid: str
    title: str
    tags: list[str]
    folder: str
    panels: list[Panel]


def read_yaml_files(folder: Path) -> list[dict[str, Any]]:
    files = sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")])
    return [yaml.safe_load(path.read_text(encoding="utf-8")) or {} for path in files]


def load_datasources(provisioning: Path) -> list[Datasource]:
    return [
        Datasource(
            name=source["name"],
            uid=source.get("uid", source["name"]),
            type=source["type"],
            url=source.get("url", ""),
            default=bool(source.get("isDefault", False)),
        )
        for config in read_yaml_files(provisioning / "datasources")
        for source in config.get("datasources", [])
    ]


def uid_of(datasource: Any) -> str | None:
    """A panel's or target's datasource reference: {"uid": ...}, a bare name, or none."""
    if isinstance(datasource, dict):
        uid = datasource.get("uid")
        return str(uid) if uid else None
    return str(datasource) if datasource else None


def panels_of(items: list[dict[str, Any]]) -> list[Panel]:
    """The panels, a row's own panels included (a collapsed row holds them)."""
    panels = []
    for item in items:
        panels.extend(panels_of(item.get("panels", [])))
        exprs = [target["expr"] for target in item.get("targets", []) if target.get("expr")]
        if exprs:
            targets = item.get("targets", [])
            uid = uid_of(item.get("datasource")) or next(
                (uid_of(t.get("datasource")) for t in targets if t.get("datasource")), None
            )
            panels.append(Panel(item.get("title", ""), uid, exprs))
    return panels


def load_dashboards(provisioning: Path, root: Path = Path("/")) -> list[Dashboard]:
    """The dashboards of every `file` provider; its options.path is a path of the container's
    file system, `root` (a test lays the mounts out under a folder)."""
    dashboards = []
    for config in read_yaml_files(provisioning / "dashboards"):
        for provider in config.get("providers", []):
            if provider.get("type", "file") != "file":
                continue
            folder = root / str(provider["options"]["path"]).lstrip("/")
            for path in sorted(folder.rglob("*.json")):
                board = json.loads(path.read_text(encoding="utf-8"))
                dashboards.append(
                    Dashboard(
                        uid=board["uid"],
                        title=board["title"],
                        tags=list(board.get("tags", [])),
                        folder=provider.get("folder", ""),
                        panels=panels_of(board.get("panels", [])),
                    )
                )
    return dashboards


def exported_names(datasource: Datasource) -> set[str]:
    """The metric names a Prometheus datasource holds series of."""
    url = f"{datasource.url.rstrip('/')}/api/v1/label/__name__/values"
    with urllib.request.urlopen(url, timeout=QUERY_TIMEOUT_S) as response:
        return set(json.loads(response.read())["data"])


def dashboard_metrics(
    dashboards: list[Dashboard], datasources: list[Datasource]
) -> dict[str, dict[str, Any]]:
    """Per dashboard uid: the metric names its panels use and those missing from their
    datasource (or why a datasource could not be asked)."""
    by_uid = {source.uid: source for source in datasources}
    default = next((source for source in datasources if source.default), None)
    known: dict[str, set[str] | str] = {}  # datasource uid -> its names, or the error
    report = {}
    for board in dashboards:
        used: set[str] = set()
        missing: set[str] = set()
        errors: set[str] = set()
        for panel in board.panels:
            source = by_uid.get(panel.datasource_uid) if panel.datasource_uid else default
            names = {name for expr in panel.exprs for name in metric_names(expr)}
            used |= names
            if source is None:
                errors.add(f"panel {panel.title!r}: no datasource {panel.datasource_uid!r}")
                continue
            if source.uid not in known:
                try:
                    known[source.uid] = exported_names(source)
                except Exception as failure:  # noqa: BLE001 - reported, not raised
                    known[source.uid] = f"{source.url}: {type(failure).__name__}: {failure}"
            exported = known[source.uid]
            if isinstance(exported, str):
                errors.add(exported)
            else:
                missing |= names - exported
        report[board.uid] = {
            "metrics": sorted(used),
            "missing": sorted(missing),
            "errors": sorted(errors),
        }
    return report


def search_hit(number: int, board: Dashboard) -> dict[str, Any]:
    slug = re.sub(r"[^a-z0-9]+", "-", board.title.lower()).strip("-")
    return {
        "id": number,
        "uid": board.uid,
        "title": board.title,
        "uri": f"db/{slug}",
        "url": f"/d/{board.uid}/{slug}",
        "slug": "",
        "type": "dash-db",
        "tags": board.tags,
        "isStarred": False,
        "folderTitle": board.folder,
    }


def serve(
    address: tuple[str, int], dashboards: list[Dashboard], datasources: list[Datasource]
) -> None:
    class Api(BaseHTTPRequestHandler):
        def route(self) -> tuple[int, Any]:
            url = urllib.parse.urlsplit(self.path)
            if url.path == "/api/health":
                return 200, {
                    "commit": "stand-in",
                    "database": "ok",
                    "version": VERSION,
                    "dashboardMetrics": dashboard_metrics(dashboards, datasources),
                }
            if url.path == "/api/search":
                query = urllib.parse.parse_qs(url.query).get("query", [""])[0].lower()
                return 200, [
                    search_hit(number, board)
                    for number, board in enumerate(dashboards, start=1)
                    if query in board.title.lower()
                ]
            return 404, {"message": f"{url.path}: not in this stand-in"}

        def do_GET(self) -> None:
            status, body = self.route()
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    ThreadingHTTPServer(address, Api).serve_forever()


def main() -> None:
    provisioning = Path(os.environ.get("GF_PATHS_PROVISIONING", "/etc/grafana/provisioning"))
    host = os.environ.get("GF_SERVER_HTTP_ADDR") or "0.0.0.0"
    port = int(os.environ.get("GF_SERVER_HTTP_PORT", "3000"))
    datasources = load_datasources(provisioning)
    dashboards = load_dashboards(provisioning)
    # As PID 1 of its container, the process would otherwise ignore `podman stop`'s SIGTERM.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(
        f"grafana stand-in: {len(datasources)} datasources, {len(dashboards)} dashboards"
        f" from {provisioning}",
        flush=True,
    )
    serve((host, port), dashboards, datasources)


if __name__ == "__main__":
    main()
