"""Run kvmesh services as real subprocesses for service and e2e tests."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.grpc_server import READY_PREFIX

REPO_ROOT = Path(__file__).resolve().parent.parent

STARTED: list[ServiceProcess] = []
"""Every service started in this test session, for the scan of their logs at its end."""

_ALARMS = (" ERROR ", " CRITICAL ", "Traceback (most recent call last)")


_RECORD_START = re.compile(r"\d{4}-\d\d-\d\d ")
"""How every log record of a service begins (kvmesh.telemetry's format): lines that do not
are the rest of the record above them (a traceback, asyncio's task repr)."""


def alarming_lines(output: str) -> list[str]:
    """The ERROR/CRITICAL log records and tracebacks in a service's output, each with the lines
    that continue it (which say where: the traceback's frames, the task that was destroyed)."""
    found: list[str] = []
    in_alarm = False
    for line in output.splitlines():
        if any(alarm in line for alarm in _ALARMS):
            found.append(line)
            in_alarm = True
        elif in_alarm and line and not _RECORD_START.match(line):
            found[-1] += "\n" + line
        else:
            in_alarm = False
    return found


@dataclass
class ServiceProcess:
    """A service started with `python -m services.<name>`, ready to take calls."""

    name: str
    proc: subprocess.Popen[str]
    address: str
    port: int
    metrics_port: int | None
    output: list[str] = field(default_factory=list)
    http_port: int | None = None
    """The gateway's OpenAI HTTP door, when it serves one."""

    @property
    def http_address(self) -> str:
        assert self.http_port is not None, f"{self.name} serves no HTTP door"
        return f"{self.address.rsplit(':', 1)[0]}:{self.http_port}"

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM, then wait; kills and fails loudly if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"{self.name} ignored SIGTERM for {timeout}s") from None
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log(self) -> str:
        """Everything the process printed so far."""
        return "".join(self.output)


def start_service(
    module: str,
    args: Sequence[str] = (),
    *,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> ServiceProcess:
    """Starts `python -m <module> <args>` and waits for its ready line."""
    proc_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        env=proc_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output: list[str] = []
    ready: list[dict[str, object]] = []
    seen = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            if line.startswith(READY_PREFIX) and not ready:
                ready.append(json.loads(line[len(READY_PREFIX) :]))
                seen.set()
        seen.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready and time.monotonic() < deadline and proc.poll() is None:
        seen.wait(0.1)
    if not ready:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{module} did not become ready:\n{''.join(output)}")
    info = ready[0]
    metrics, http = info.get("metrics_port"), info.get("http_port")
    started = ServiceProcess(
        name=module,
        proc=proc,
        address=str(info["address"]),
        port=int(str(info["port"])),
        metrics_port=int(str(metrics)) if metrics is not None else None,
        output=output,
        http_port=int(str(http)) if http is not None else None,
    )
    STARTED.append(started)
    return started
