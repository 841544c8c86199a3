"""What each entry point loads: nothing of torch outside the worker, no server in the SDK.

The import-linter contracts in pyproject.toml hold the rooms' rules statically; these run the
real imports in a fresh interpreter where torch cannot be imported at all.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

NO_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is made unimportable by this test")
        return None

sys.meta_path.insert(0, NoTorch())
"""

ENTRY_POINTS = [
    "kvmesh",
    "kvmesh.client",
    "kvmesh.cli",
    "kvmesh.up",
    "services.admission.__main__",
    "services.cache.__main__",
    "services.router.__main__",
    "services.worker.config",
    "services.worker.engine.api",
    "services.worker.engine.config",
]


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_entry_point_imports_without_torch(module: str) -> None:
    result = run_python(
        NO_TORCH + f"import importlib; importlib.import_module({module!r})\n"
        "assert 'torch' not in sys.modules\n"
    )
    assert result.returncode == 0, result.stderr


def test_the_engine_does_need_torch() -> None:
    """The finder above really blocks torch: the engine itself cannot load without it."""
    result = run_python(NO_TORCH + "import services.worker.engine.engine\n")
    assert result.returncode != 0
    assert "made unimportable by this test" in result.stderr


def test_the_sdk_loads_no_server_module() -> None:
    result = run_python(
        "import sys, kvmesh.client\n"
        "servers = [m for m in sys.modules if m.startswith('services') or m in "
        "('kvmesh.grpc_server', 'kvmesh.server_tracing', 'prometheus_client', "
        "'opentelemetry.sdk', 'grpc_reflection.v1alpha.reflection', 'grpc_health.v1.health')]\n"
        "assert not servers, servers\n"
    )
    assert result.returncode == 0, result.stderr
