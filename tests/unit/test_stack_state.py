"""Each `kvmesh up` keeps its own state: two stacks from one checkout stay apart."""

from __future__ import annotations

import io
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvmesh.control import (
    control_answers,
    default_state_dir,
    read_stack_file,
    serve_control,
    socket_path,
    write_stack_file,
)
from kvmesh.stack import StackOptions
from kvmesh.up import PipeSafeOutput, run_up


def test_state_folders_are_keyed_by_the_gateway_port() -> None:
    assert default_state_dir(50051) == Path(".kvmesh/stack-50051")
    assert default_state_dir(50151) != default_state_dir(50051)


def test_stack_file_round_trip(tmp_path: Path) -> None:
    assert read_stack_file(tmp_path) is None
    write_stack_file(tmp_path, {"gateway": "127.0.0.1:1", "router": "127.0.0.1:2"})
    assert read_stack_file(tmp_path) == {"gateway": "127.0.0.1:1", "router": "127.0.0.1:2"}


async def test_a_stale_socket_file_is_no_running_stack(tmp_path: Path) -> None:
    stale = socket_path(tmp_path)
    with socket.socket(socket.AF_UNIX) as left_behind:
        left_behind.bind(str(stale))  # bound, never listening: what a killed stack leaves
    assert stale.exists()
    assert not await control_answers(stale)


async def test_a_second_up_from_the_same_state_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def answer(request: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True}

    running = await serve_control(socket_path(tmp_path), answer)
    out = io.StringIO()
    try:
        code = await run_up(StackOptions(state_dir=tmp_path), None, Console(file=out))
    finally:
        running.close()
    assert code == 1
    assert "a stack is already running from" in capsys.readouterr().err
    assert not (tmp_path / "pools.yaml").exists(), "the running stack's state was overwritten"


def test_output_goes_quiet_when_its_reader_is_gone() -> None:
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as stream:
        output = PipeSafeOutput(stream)
        assert output.write("seen\n") == 5
        assert os.read(read_end, 100) == b"seen\n"
        os.close(read_end)  # `tee` ended
        assert output.write("lost\n") == 5  # no BrokenPipeError
        assert output.write("still lost\n") == 11
        assert not output.isatty()
