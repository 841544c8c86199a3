"""The `kvmesh` command: one argparse subcommand per function.

kvmesh generate [--target HOST:PORT] [--model M] [--max-tokens N] [--temperature T]
                [--seed S] [--priority interactive|batch] [--json]
                [--json-schema FILE | --regex RE | --choice OPTION ...] PROMPT
kvmesh chat     [--target HOST:PORT] [--model M] [--system TEXT] ...
kvmesh tenants add NAME --file tenants.yaml [limits...]
kvmesh up | bench | status | scale      (kvmesh.cli_stack)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

from kvmesh.client import (
    API_KEY_ENV,
    CA_FILE_ENV,
    CACHE_POLICIES,
    DEFAULT_TARGET,
    PRIORITIES,
    TARGET_ENV,
    Client,
    GenerationResult,
)
from kvmesh.errors import InvalidArgument, KvmeshError
from kvmesh.version import kvmesh_version

Commands = argparse._SubParsersAction  # argparse keeps the class private


DESCRIPTION = (
    "kvmesh serves large language models as a mesh of gRPC services (admission gateway, "
    "response cache, router, prefill and decode workers). `kvmesh up` runs the mesh on this "
    "machine; generate, chat and bench talk to its gateway; status and scale manage it."
)


class DefaultsFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to a flag's help where X says something (not None, False, "" or [])."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        says_nothing = action.default is None or action.default is False
        if says_nothing or action.default in ("", [], argparse.SUPPRESS) or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)"


class OneLineParser(argparse.ArgumentParser):
    """argparse with every flag's default in its help, and a usage mistake as one line naming
    the fix instead of the usage block."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kvmesh", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"kvmesh {kvmesh_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate_command(commands)
    add_chat_command(commands)
    add_tenants_command(commands)
    from kvmesh.cli_stack import add_stack_commands

    add_stack_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except KvmeshError as error:
        print(f"kvmesh: {describe_error(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code


def describe_error(error: KvmeshError) -> str:
    """STATUS: message (retry after Ns)."""
    retry = f" (retry after {error.retry_after_s:.1f}s)" if error.retry_after_s else ""
    return f"{error.status}: {error.message}{retry}"


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    """--target and --api-key, which fall back to $KVMESH_TARGET and $KVMESH_API_KEY."""
    parser.add_argument(
        "--target",
        default=None,
        help=f"gateway HOST:PORT [env {TARGET_ENV}; else {DEFAULT_TARGET}]",
    )
    parser.add_argument("--api-key", default=None, help=f"tenant API key [env {API_KEY_ENV}]")
    parser.add_argument(
        "--ca-file",
        default=None,
        help=f"CA certificate of a gateway served over TLS (kvmesh up --tls) [env {CA_FILE_ENV}]",
    )


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="model tier, or 'auto' ('': the gateway's)")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="most tokens to generate (None: gateway's)"
    )
    parser.add_argument(
        "--temperature", type=float, default=None, help="0 is greedy (None: the model's)"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument(
        "--priority", choices=list(PRIORITIES), default="interactive", help="scheduling class"
    )
    parser.add_argument(
        "--cache", choices=list(CACHE_POLICIES), default="use", help="response-cache policy"
    )
    parser.add_argument("--deadline", type=float, default=None, help="seconds (None: gateway's)")
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema",
        type=Path,
        default=None,
        metavar="FILE",
        help="answer with JSON that validates against the JSON Schema in FILE",
    )
    constraint.add_argument(
        "--regex", default=None, help="answer with text that matches this regular expression"
    )
    constraint.add_argument(
        "--choice",
        action="append",
        default=None,
        metavar="OPTION",
        help="answer with exactly one of these strings (repeat the flag for each option)",
    )


def _read_schema(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except OSError as error:
        raise InvalidArgument("--json-schema", f"cannot read {path}: {error.strerror}") from None


def _request_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "json_schema": _read_schema(args.json_schema),
        "regex": args.regex,
        "choice": args.choice,
        "model": args.model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "priority": args.priority,
        "cache_policy": args.cache,
        "deadline_s": args.deadline,
    }


# --- generate -----------------------------------------------------------------------------


def add_generate_command(commands: Commands) -> None:
    generate = commands.add_parser("generate", help="generate from a prompt, streaming the text")
    add_connection_options(generate)
    _add_sampling_options(generate)
    generate.add_argument("--json", action="store_true", help="print one JSON object at the end")
    generate.add_argument(
        "--prompt-file", type=Path, default=None, help="read the prompt from this file"
    )
    generate.add_argument(
        "prompt", nargs="?", default=None, help="the prompt text; '-' reads it from stdin"
    )
    generate.set_defaults(func=cmd_generate)


def read_prompt(args: argparse.Namespace, inp: TextIO) -> str:
    """The prompt from the argument, '-' (stdin) or --prompt-file; exactly one of them."""
    if (args.prompt is None) == (args.prompt_file is None):
        raise InvalidArgument("prompt", "give the prompt text, '-' for stdin, or --prompt-file")
    if args.prompt_file is not None:
        try:
            return str(args.prompt_file.read_text(encoding="utf-8"))
        except OSError as error:
            raise InvalidArgument(
                "--prompt-file", f"cannot read {args.prompt_file}: {error.strerror}"
            ) from None
    return inp.read() if args.prompt == "-" else str(args.prompt)


def cmd_generate(args: argparse.Namespace) -> int:
    result = asyncio.run(_generate(args, sys.stdin, sys.stdout))
    return 0 if result.finish_reason != "error" else 1


async def _generate(args: argparse.Namespace, inp: TextIO, out: TextIO) -> GenerationResult:
    prompt = read_prompt(args, inp)
    async with Client(args.target, api_key=args.api_key, ca_file=args.ca_file) as client:
        result = await _stream_to(client, prompt, _request_options(args), out, not args.json)
    if args.json:
        print(json.dumps(result.to_json()), file=out)
    else:
        print(file=out)
    return result


async def _stream_to(
    client: Client, prompt: Any, options: dict[str, Any], out: TextIO, echo: bool
) -> GenerationResult:
    """Runs a generation, writing its text to `out` as it arrives when `echo`."""
    async with client.stream(prompt, **options) as stream:
        async for chunk in stream:
            if echo:
                out.write(chunk.text)
                out.flush()
        result = stream.result
    if result.finish_reason not in ("stop", "length") and echo:
        note = f" ({result.error_message})" if result.error_message else ""
        out.write(f"\n[finished: {result.finish_reason}{note}]")
    warn_if_cut_short(result, sys.stderr)
    return result


def warn_if_cut_short(result: GenerationResult, err: TextIO) -> None:
    """A DEADLINE finish is a normal end on the wire (status OK, the tokens so far), so the
    CLI says on stderr that the answer is incomplete, whatever --json prints."""
    if result.finish_reason == "deadline":
        tokens = len(result.token_ids)
        print(
            f"kvmesh: warning: the deadline passed after {tokens} tokens; the answer is cut short",
            file=err,
        )


# --- chat ---------------------------------------------------------------------------------


def add_chat_command(commands: Commands) -> None:
    chat = commands.add_parser(
        "chat", help="chat with a model (its chat template is applied by the gateway)"
    )
    add_connection_options(chat)
    _add_sampling_options(chat)
    chat.add_argument("--system", default="", help="system message that starts the conversation")
    chat.set_defaults(func=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    asyncio.run(_chat(args, sys.stdin, sys.stdout))
    return 0


async def _chat(args: argparse.Namespace, inp: TextIO, out: TextIO) -> None:
    """Reads user turns from `inp` until EOF or /exit; keeps the whole conversation."""
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = inp.isatty()
    async with Client(args.target, api_key=args.api_key, ca_file=args.ca_file) as client:
        while True:
            if interactive:
                out.write("> ")
                out.flush()
            line = await asyncio.to_thread(inp.readline)
            if not line or line.strip() == "/exit":
                return
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            result = await _stream_to(client, messages, _request_options(args), out, True)
            out.write("\n")
            messages.append({"role": "assistant", "content": result.text})


# --- tenants ------------------------------------------------------------------------------


def add_tenants_command(commands: Commands) -> None:
    tenants = commands.add_parser("tenants", help="manage the gateway's tenants file")
    actions = tenants.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = actions.add_parser("add", help="add a tenant; prints its new API key once")
    add.add_argument("name", help="the tenant's name (unique in the file)")
    add.add_argument("--file", type=Path, required=True, help="tenants YAML (created if absent)")
    add.add_argument("--tokens-per-minute", type=int, default=0, help="0: unlimited")
    add.add_argument("--daily-tokens", type=int, default=0, help="0: unlimited")
    add.add_argument("--max-concurrent", type=int, default=0, help="0: unlimited")
    add.add_argument("--models", default="*", help="comma-separated tiers, '*' for all")
    add.add_argument(
        "--highest-priority",
        choices=list(PRIORITIES),
        default="interactive",
        help="the most urgent class the tenant may ask for",
    )
    add.add_argument("--shared-cache", action="store_true", help="share response-cache entries")
    add.add_argument("--cache-salt", default="", help="prefix-cache salt (default: the name)")
    add.add_argument("--admin", action="store_true", help="may read other tenants' usage")
    add.set_defaults(func=cmd_tenants_add)


def cmd_tenants_add(args: argparse.Namespace) -> int:
    from kvmesh.tenants import PriorityClass, Tenant, TenantFileError, add_tenant

    template = Tenant(
        name=args.name,
        key_sha256="",
        tokens_per_minute=args.tokens_per_minute,
        daily_tokens=args.daily_tokens,
        max_concurrent=args.max_concurrent,
        models=tuple(m.strip() for m in args.models.split(",") if m.strip()),
        highest_priority=PriorityClass.parse(args.highest_priority),
        shared_cache=args.shared_cache,
        cache_salt=args.cache_salt,
        admin=args.admin,
    )
    try:
        tenant, api_key = add_tenant(args.file, template)
    except (TenantFileError, ValueError) as error:
        print(f"kvmesh: {error}", file=sys.stderr)
        return 2
    print(api_key)
    print(
        f"tenant {tenant.name!r} added to {args.file}; the key above is shown only once "
        "(the file keeps its SHA-256 hash)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
