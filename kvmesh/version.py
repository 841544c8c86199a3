"""The installed kvmesh version: `kvmesh --version`, and what a worker reports in Stats so the
router pairs prefill and decode workers of one release only."""

from __future__ import annotations

from importlib import metadata


def kvmesh_version() -> str:
    """The installed package's version."""
    try:
        return metadata.version("kvmesh")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"
