"""The e2e suite's log scan (ordinary cancels, deadlines, disconnects and kills log no ERROR),
and the split stack of the worker tests, one per module that asks for it."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from kvmesh.telemetry import TRACE_FILE_ENV
from tests.e2e.split_stack import KV_SEND_MB_S, LEASE_TTL_S, Stack
from tests.procs import STARTED, alarming_lines, start_service
from tests.service.worker_mesh import worker_args


@pytest.fixture(scope="session", autouse=True)
def no_error_in_any_service_log() -> Iterator[None]:
    yield
    found = {
        f"{process.name} {process.address}": lines
        for process in STARTED
        if (lines := alarming_lines(process.log()))
    }
    assert not found, f"ERROR lines or tracebacks in service logs: {found}"


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prefill_args = worker_args(tiny_llama_dir, "prefill", "--kv-send-max-mb-s", KV_SEND_MB_S)
    prefill_args += ["--lease-ttl-s", LEASE_TTL_S, "--metrics-port", "0"]
    plans = [prefill_args, prefill_args, worker_args(tiny_llama_dir, "decode")]
    with ThreadPoolExecutor(len(plans)) as pool:
        workers = list(pool.map(lambda args: start_service("services.worker", args), plans))
    pools = tmp_path_factory.mktemp("router") / "pools.yaml"
    pools.write_text(
        yaml.safe_dump(
            {
                "tiers": [
                    {
                        "name": "tiny",
                        "prefill": [w.address for w in workers[:2]],
                        "decode": [workers[2].address],
                    }
                ]
            }
        )
    )
    trace_file = pools.parent / "router-spans.jsonl"
    router_args = ["--config", str(pools), "--port", "0", "--metrics-port", "-1"]
    router = start_service(
        "services.router",
        [*router_args, "--refresh-interval-s", "0.2"],
        env={TRACE_FILE_ENV: str(trace_file)},
    )
    started = Stack(workers[:2], workers[2], router, trace_file)
    yield started
    for process in started.all():
        process.terminate()
