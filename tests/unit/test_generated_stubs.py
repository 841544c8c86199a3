"""The committed stubs in kvmesh/v1 must equal a fresh generation from protos/."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

from tests.procs import REPO_ROOT

GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out: Path) -> None:
    """The same command as `make protos`, into `out`."""
    bin_dir = Path(sys.executable).parent
    protos = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "protos").rglob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            "protos",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--mypy_out={out}",
            f"--mypy_grpc_out={out}",
            f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
            *protos,
        ],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
    )


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    generate(tmp_path)
    fresh_dir = tmp_path / "kvmesh" / "v1"
    committed_dir = REPO_ROOT / "kvmesh" / "v1"
    fresh = sorted(p.name for p in fresh_dir.iterdir() if p.name.endswith(GENERATED_SUFFIXES))
    committed = sorted(
        p.name for p in committed_dir.iterdir() if p.name.endswith(GENERATED_SUFFIXES)
    )
    assert fresh == committed, "generated file set differs: run `make protos`"
    stale = [n for n in fresh if not filecmp.cmp(fresh_dir / n, committed_dir / n, shallow=False)]
    assert not stale, f"stale generated stubs {stale}: run `make protos` and commit"


def test_a_proto_edit_is_detected(tmp_path: Path) -> None:
    """The check above can fail: generating from an edited proto gives different bytes."""
    edited = tmp_path / "edited"
    shutil.copytree(REPO_ROOT / "protos", edited / "protos")
    common = edited / "protos" / "kvmesh" / "v1" / "common.proto"
    common.write_text(common.read_text().replace("bool ignore_eos = 9;", "bool ignore_eos = 99;"))
    out = tmp_path / "out"
    out.mkdir()
    bin_dir = Path(sys.executable).parent
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            "protos",
            f"--python_out={out}",
            f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
            "protos/kvmesh/v1/common.proto",
        ],
        cwd=edited,
        check=True,
    )
    fresh = out / "kvmesh" / "v1" / "common_pb2.py"
    assert not filecmp.cmp(fresh, REPO_ROOT / "kvmesh" / "v1" / "common_pb2.py", shallow=False)
