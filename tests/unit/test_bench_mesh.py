"""The benchmarks name the command that repeats their run in what they write."""

from __future__ import annotations

from bench import mesh, openai_http
from bench.report import repeat_command


def test_the_command_names_every_flag_off_its_default() -> None:
    def command(argv: list[str]) -> str:
        return repeat_command("bench.mesh", mesh.parse_args(argv), mesh.parse_args)

    assert command([]) == "python -m bench.mesh"
    assert command(["--quick", "--requests", "8"]) == "python -m bench.mesh --quick"
    assert (
        command(["--sequential-requests", "40", "--model", "tiny"])
        == "python -m bench.mesh --model tiny --sequential-requests 40"
    )
    args = openai_http.parse_args(["--concurrency", "16"])
    assert repeat_command("bench.openai_http", args, openai_http.parse_args) == (
        "python -m bench.openai_http --concurrency 16"
    )
