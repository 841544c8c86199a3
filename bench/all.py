"""Every benchmark in turn, so one command produces the whole of BENCHMARKS.md.

    .venv/bin/python -m bench.all            # full figures (most of an hour on 2 cores)
    .venv/bin/python -m bench.all --quick    # fewer requests and shorter runs

Each script runs in its own process (they load models and start meshes of their own) and
rewrites only its own section of BENCHMARKS.md. vllm_serve runs only where `make test-vllm`
built .venv-vllm. The comparison with vLLM's CPU build has its own target: `make bench-peers`
(bench/peers.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# script -> the arguments that make it short under --quick.
QUICK_ARGS: dict[str, tuple[str, ...]] = {
    "engine": ("--quick",),
    "disagg": ("--duration-s", "20", "--skip-agreement"),
    "admission": ("--interactive", "10", "--cache-hits", "50", "--batch-max-in-flight", "1"),
    "mesh": ("--quick",),
    "openai_http": ("--quick",),
    "structured": ("--quick",),
    "vllm_serve": ("--quick",),
}


def scripts() -> list[str]:
    """The benchmarks this environment can run, in order."""
    names = ["engine", "disagg", "admission", "mesh", "openai_http", "structured"]
    if Path(".venv-vllm/bin/python").exists():  # vllm_serve's client and server run there
        names.append("vllm_serve")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs of every script")
    args = parser.parse_args(argv)
    failed = []
    for name in scripts():
        command = [sys.executable, "-m", f"bench.{name}", *(QUICK_ARGS[name] if args.quick else ())]
        print(f"== {' '.join(command[1:])}", flush=True)
        started = time.perf_counter()
        code = subprocess.run(command, check=False).returncode
        print(
            f"== bench.{name}: exit {code} after {time.perf_counter() - started:.0f} s", flush=True
        )
        if code != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
