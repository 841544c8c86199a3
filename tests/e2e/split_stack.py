"""The split stack of the e2e worker tests (the `stack` fixture in conftest.py): two prefill
workers, one decode worker and the router, each a process, on the tiny model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.procs import ServiceProcess

KV_SEND_MB_S = "0.1"  # each prefill worker sends KV at 100 kB/s: a pull lasts about a second
LEASE_TTL_S = "1"


@dataclass
class Stack:
    prefill: list[ServiceProcess]
    decode: ServiceProcess
    router: ServiceProcess
    trace_file: Path
    """The router's spans, one JSON object per line."""

    def all(self) -> list[ServiceProcess]:
        return [*self.prefill, self.decode, self.router]
