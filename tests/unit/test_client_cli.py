"""The SDK's request building and the CLI's offline commands (tenants add)."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from kvmesh.cli import (
    _request_options,
    build_parser,
    describe_error,
    main,
    read_prompt,
    warn_if_cut_short,
)
from kvmesh.client import (
    GenerationResult,
    UsageInfo,
    build_request,
    resolve_api_key,
    resolve_target,
)
from kvmesh.errors import InvalidArgument, ResourceExhausted
from kvmesh.stack import StackOptions, plan_workers
from kvmesh.tenants import PriorityClass, TenantRegistry, load_tenants
from kvmesh.up import try_command
from kvmesh.v1 import common_pb2


def test_build_request_maps_every_option() -> None:
    request = build_request(
        "hello",
        model="tiny",
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        seed=3,
        stop=["\n"],
        ignore_eos=True,
        priority="batch",
        cache_policy="refresh",
        idempotency_key="k",
        labels={"difficulty": "easy"},
    )
    assert request.prompt.text == "hello" and request.model == "tiny"
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.top_k, sampling.seed) == (7, 40, 3)
    assert sampling.temperature == pytest.approx(0.5) and sampling.ignore_eos
    assert list(sampling.stop) == ["\n"]
    assert request.priority == common_pb2.PRIORITY_BATCH
    assert request.cache_policy == common_pb2.CACHE_POLICY_REFRESH
    assert request.idempotency_key == "k" and dict(request.labels) == {"difficulty": "easy"}


def test_unset_sampling_fields_stay_unset() -> None:
    sampling = build_request("x").sampling
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        assert not sampling.HasField(name)


def test_prompt_kinds() -> None:
    assert list(build_request([1, 2, 3]).prompt.token_ids.ids) == [1, 2, 3]
    chat = build_request([{"role": "user", "content": "hi"}]).prompt.chat
    assert chat.add_generation_prompt and chat.messages[0].role == "user"
    with pytest.raises(TypeError):
        build_request([1.5])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="priority"):
        build_request("x", priority="urgent")
    with pytest.raises(ValueError, match="cache_policy"):
        build_request("x", cache_policy="sometimes")


def test_errors_are_described_with_their_status_and_retry() -> None:
    error = ResourceExhausted("over budget", retry_after_s=12.0)
    assert describe_error(error) == "RESOURCE_EXHAUSTED: over budget (retry after 12.0s)"


def test_tenants_add_prints_the_key_once_and_stores_its_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tenants.yaml"
    args = ["tenants", "add", "acme", "--file", str(path), "--tokens-per-minute", "900",
            "--models", "tiny,auto", "--highest-priority", "batch", "--shared-cache"]  # fmt: skip
    assert main(args) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("kvm_") and key not in path.read_text()
    (tenant,) = load_tenants(path)
    assert tenant.tokens_per_minute == 900 and tenant.models == ("tiny", "auto")
    assert tenant.highest_priority is PriorityClass.BATCH and tenant.shared_cache
    assert TenantRegistry.from_file(path).by_key(key) == tenant
    assert main(args) == 2  # the name exists
    assert "exists" in capsys.readouterr().err


def every_parser(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser` and each of its subcommands' parsers, depth first."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                yield from every_parser(child)


def test_every_flag_of_every_command_has_help() -> None:
    missing = [
        f"{parser.prog} {action.dest}"
        for parser in every_parser(build_parser())
        for action in parser._actions
        if not action.help and not isinstance(action, argparse._SubParsersAction)
    ]
    assert not missing


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvmesh {metadata.version('kvmesh')}"


def test_a_default_that_says_something_is_in_the_help() -> None:
    up_help = next(p for p in every_parser(build_parser()) if p.prog == "kvmesh up").format_help()
    assert "(default: colocated)" in up_help and "(default: 0)" in up_help
    assert "(default: None)" not in up_help


def test_up_defaults_to_one_colocated_worker_and_splits_when_asked() -> None:
    """On one machine colocated serves more tokens/s (BENCHMARKS.md "Peers"): the default of
    the CLI and of StackOptions; --mode disaggregated gives a prefill and a decode worker."""
    parse = build_parser().parse_args
    assert parse(["up"]).mode == StackOptions().mode == "colocated"
    assert [w.role for w in plan_workers(StackOptions())] == ["colocated"]
    split = StackOptions(mode=parse(["up", "--mode", "disaggregated"]).mode)
    assert [w.role for w in plan_workers(split)] == ["prefill", "decode"]


def test_bench_takes_target_and_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["bench"])
    monkeypatch.setenv("KVMESH_TARGET", "10.0.0.7:6000")
    monkeypatch.setenv("KVMESH_API_KEY", "kvm_from_env")
    assert resolve_target(args.target) == "10.0.0.7:6000"
    assert resolve_api_key(args.api_key) == "kvm_from_env"
    flags = build_parser().parse_args(["bench", "--target", "h:1", "--api-key", ""])
    assert (resolve_target(flags.target), resolve_api_key(flags.api_key)) == ("h:1", "")


def test_generate_reads_the_prompt_from_stdin_or_a_file(tmp_path: Path) -> None:
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("from a file\n", encoding="utf-8")
    parse = build_parser().parse_args
    assert read_prompt(parse(["generate", "-"]), io.StringIO("from stdin\n")) == "from stdin\n"
    from_file = parse(["generate", "--prompt-file", str(prompt_file)])
    assert read_prompt(from_file, io.StringIO("")) == "from a file\n"
    assert read_prompt(parse(["generate", "typed"]), io.StringIO("")) == "typed"
    for neither_or_both in (["generate"], ["generate", "x", "--prompt-file", str(prompt_file)]):
        with pytest.raises(InvalidArgument, match="give the prompt text"):
            read_prompt(parse(neither_or_both), io.StringIO(""))
    with pytest.raises(InvalidArgument, match="cannot read"):
        read_prompt(parse(["generate", "--prompt-file", str(tmp_path / "none")]), io.StringIO(""))


def test_up_prints_a_first_command_that_runs_as_printed(tmp_path: Path) -> None:
    command = try_command("127.0.0.1:50051", StackOptions())
    program = command.split(" generate ")[0]
    assert Path(program.split()[0]).exists() and "KVMESH_API_KEY" not in command
    with_tenants = try_command("127.0.0.1:50051", StackOptions(tenants=tmp_path / "t.yaml"))
    assert "KVMESH_API_KEY" in with_tenants and str(tmp_path / "t.yaml") in with_tenants


@pytest.mark.parametrize("service", ["admission", "cache", "router", "worker"])
def test_services_name_themselves_in_their_usage(service: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", f"services.{service}", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    assert result.stdout.startswith(f"usage: python -m services.{service} ")
    assert "; default " in result.stdout


@pytest.mark.parametrize(("reason", "warned"), [("deadline", True), ("stop", False)])
def test_a_deadline_finish_is_surfaced_on_stderr(reason: str, warned: bool) -> None:
    result = GenerationResult("Paris", [1, 2, 3], reason, "tiny", "r1", UsageInfo())
    err = io.StringIO()
    warn_if_cut_short(result, err)
    expected = "kvmesh: warning: the deadline passed after 3 tokens; the answer is cut short\n"
    assert err.getvalue() == (expected if warned else "")
    assert result.to_json()["finish_reason"] == reason  # --json carries it as is


def test_build_request_sets_one_output_constraint(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert json.loads(build_request("x", json_schema=schema).sampling.json_schema) == schema
    assert build_request("x", json_schema='{"type": "null"}').sampling.json_schema
    assert build_request("x", json_object=True).sampling.json_object
    assert build_request("x", regex="[a-z]+").sampling.regex == "[a-z]+"
    assert list(build_request("x", choice=["a", "b"]).sampling.choice.options) == ["a", "b"]
    lark = build_request("x", grammar='start: "a"', grammar_notation="lark").sampling.grammar
    assert (lark.notation, lark.source) == (common_pb2.GRAMMAR_NOTATION_LARK, 'start: "a"')
    assert build_request("x").sampling.WhichOneof("constraint") is None
    with pytest.raises(ValueError, match="at most one output constraint, got regex, choice"):
        build_request("x", regex="a", choice=["a"])
    with pytest.raises(ValueError, match="grammar_notation"):
        build_request("x", grammar="root ::= x", grammar_notation="peg")


def test_generate_takes_a_schema_file_a_regex_or_choices(tmp_path: Path) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text('{"type": "boolean"}', encoding="utf-8")
    parse = build_parser().parse_args
    options = _request_options(parse(["generate", "--json-schema", str(schema_file), "p"]))
    assert options["json_schema"] == '{"type": "boolean"}'
    assert _request_options(parse(["generate", "--regex", "[0-9]+", "p"]))["regex"] == "[0-9]+"
    choices = parse(["generate", "--choice", "yes", "--choice", "no", "p"])
    assert _request_options(choices)["choice"] == ["yes", "no"]
    with pytest.raises(InvalidArgument, match="--json-schema: cannot read"):
        _request_options(parse(["generate", "--json-schema", str(tmp_path / "none"), "p"]))
    with pytest.raises(SystemExit):  # argparse: not allowed with each other
        parse(["generate", "--regex", "a", "--choice", "a", "p"])
