"""bench.mesh names the command that repeats its run in what it writes."""

from __future__ import annotations

from bench.mesh import command_line, parse_args


def test_the_command_names_every_flag_off_its_default() -> None:
    assert command_line(parse_args([])) == "python -m bench.mesh"
    assert (
        command_line(parse_args(["--quick", "--requests", "8"])) == "python -m bench.mesh --quick"
    )
    assert (
        command_line(parse_args(["--sequential-requests", "40", "--model", "tiny"]))
        == "python -m bench.mesh --model tiny --sequential-requests 40"
    )
