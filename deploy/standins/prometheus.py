"""A stand-in for Prometheus in docker-compose.yml, for machines that reach no container registry
(make test-compose). Test infrastructure: it stores no series, only the names of those the last
scrape of each target returned.

It reads the Prometheus configuration the real server would (--config.file, default
/etc/prometheus/prometheus.yml: global.scrape_interval, each job's static_configs targets,
labels and metrics_path), scrapes every target at that interval, parses what it gets as the
Prometheus text format, and answers on --web.listen-address (default 0.0.0.0:9090):
  GET /-/ready, /-/healthy          200 once the configuration is loaded
  GET /api/v1/targets               each target's health ("up" after a scrape that answered
                                    and parsed), lastError, lastScrape and its sample count,
                                    in the shape of Prometheus's targets API
  GET /api/v1/label/__name__/values the metric (sample) names of every target's last scrape
                                    that answered, sorted, as Prometheus's label values API
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

DEFAULT_INTERVAL_S = 60.0  # Prometheus's default scrape_interval


@dataclass(slots=True)
class Target:
    job: str
    address: str
    labels: dict[str, str]
    url: str
    interval_s: float
    health: str = "unknown"
    last_error: str = ""
    last_scrape: str = "0001-01-01T00:00:00Z"
    last_duration_s: float = 0.0
    samples: int = 0
    names: frozenset[str] = frozenset()
    """The sample names of the last scrape that answered and parsed."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def scrape(self) -> None:
        start = time.monotonic()
        try:
            with urllib.request.urlopen(self.url, timeout=self.interval_s) as response:
                text = response.read().decode()
            found = [s for family in text_string_to_metric_families(text) for s in family.samples]
            samples, names = len(found), frozenset(sample.name for sample in found)
            health, error = "up", ""
        except Exception as failure:  # noqa: BLE001 - any failure is the target's health
            samples, names = 0, self.names
            health, error = "down", f"{type(failure).__name__}: {failure}"
        with self.lock:
            self.health, self.last_error, self.samples = health, error, samples
            self.names = names
            self.last_scrape = datetime.now(UTC).isoformat().replace("+00:00", "Z")
            self.last_duration_s = time.monotonic() - start

    def as_json(self) -> dict[str, Any]:
        with self.lock:
            return {
                "discoveredLabels": {"__address__": self.address, "job": self.job},
                "labels": {"instance": self.address, "job": self.job, **self.labels},
                "scrapePool": self.job,
                "scrapeUrl": self.url,
                "lastError": self.last_error,
                "lastScrape": self.last_scrape,
                "lastScrapeDuration": self.last_duration_s,
                "health": self.health,
                "scrapeInterval": f"{self.interval_s:g}s",
                "samples": self.samples,  # not in Prometheus's answer: what the scrape parsed
            }


def seconds(duration: str) -> float:
    """A Prometheus duration of one unit (5s, 1m, 250ms)."""
    for unit, factor in (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if duration.endswith(unit) and duration[: -len(unit)].isdigit():
            return int(duration[: -len(unit)]) * factor
    raise ValueError(f"duration {duration!r} is not of the form this stand-in reads")


def read_targets(config_file: str) -> list[Target]:
    with open(config_file, encoding="utf-8") as file:
        config = yaml.safe_load(file)
    default = config.get("global", {}).get("scrape_interval")
    targets = []
    for job in config.get("scrape_configs", []):
        interval = job.get("scrape_interval", default)
        path = job.get("metrics_path", "/metrics")
        for static in job.get("static_configs", []):
            for address in static["targets"]:
                targets.append(
                    Target(
                        job=job["job_name"],
                        address=address,
                        labels=dict(static.get("labels", {})),
                        url=f"http://{address}{path}",
                        interval_s=seconds(interval) if interval else DEFAULT_INTERVAL_S,
                    )
                )
    return targets


def scrape_forever(target: Target) -> None:
    while True:
        target.scrape()
        time.sleep(target.interval_s)


def serve(address: str, targets: list[Target]) -> None:
    class Api(BaseHTTPRequestHandler):
        def route(self) -> tuple[int, bytes, str]:
            path = self.path.split("?", 1)[0]
            if path in ("/-/ready", "/-/healthy"):
                return 200, b"Prometheus stand-in is Ready.\n", "text/plain"
            if path == "/api/v1/targets":
                active = [target.as_json() for target in targets]
                body = {
                    "status": "success",
                    "data": {"activeTargets": active, "droppedTargets": []},
                }
                return 200, json.dumps(body).encode(), "application/json"
            if path == "/api/v1/label/__name__/values":
                names = sorted(set().union(*(target.names for target in targets)))
                body = {"status": "success", "data": names}
                return 200, json.dumps(body).encode(), "application/json"
            return 404, f"{path}: not in this stand-in\n".encode(), "text/plain"

        def do_GET(self) -> None:
            self.answer(*self.route(), body=True)

        def do_HEAD(self) -> None:
            self.answer(*self.route(), body=False)

        def answer(self, status: int, data: bytes, kind: str, body: bool) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    host, port = address.rsplit(":", 1)
    ThreadingHTTPServer((host or "0.0.0.0", int(port)), Api).serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config.file", dest="config", default="/etc/prometheus/prometheus.yml")
    parser.add_argument("--web.listen-address", dest="listen", default="0.0.0.0:9090")
    args, _ = parser.parse_known_args()
    targets = read_targets(args.config)
    for target in targets:
        threading.Thread(target=scrape_forever, args=(target,), daemon=True).start()
    # As PID 1 of its container, the process would otherwise ignore `podman stop`'s SIGTERM.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"prometheus stand-in: {len(targets)} targets from {args.config}", flush=True)
    serve(args.listen, targets)


if __name__ == "__main__":
    main()
