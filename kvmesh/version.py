"""The installed kvmesh version: `kvmesh --version`, and what a worker reports in Stats so the
router pairs prefill and decode workers of one release only."""

from __future__ import annotations

import functools
from importlib import metadata


@functools.cache
def kvmesh_version() -> str:
    """The installed package's version (looked up once: a worker reports it in every Stats,
    and the lookup reads every installed distribution's metadata when kvmesh is not one)."""
    try:
        return metadata.version("kvmesh")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"
