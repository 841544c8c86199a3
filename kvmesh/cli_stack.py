"""The stack's CLI commands: `kvmesh up`, `kvmesh bench`, `kvmesh status`, `kvmesh scale`."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import TextIO, cast

import grpc
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvmesh.bench_report import (
    RequestResult,
    Slo,
    check_plotting,
    plot_results,
    summarize,
    summary_table,
)
from kvmesh.channels import member_channel
from kvmesh.cli import add_connection_options
from kvmesh.client import resolve_api_key, resolve_ca_file, resolve_target
from kvmesh.control import call_control, default_state_dir, read_stack_file, socket_path
from kvmesh.errors import InvalidArgument, KvmeshError, Unavailable, Unimplemented
from kvmesh.loadgen import LoadSpec, run_load
from kvmesh.rpc_status import error_from_rpc
from kvmesh.stack import (
    GATEWAY_PORT,
    OPENAI_HTTP_PORT,
    ROUTER_PORT,
    StackOptions,
)
from kvmesh.up import PipeSafeOutput, operator, run_up
from kvmesh.v1 import router_pb2, router_pb2_grpc, worker_pb2

DEFAULT_ROUTER = f"127.0.0.1:{ROUTER_PORT}"


def add_stack_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Registers up, bench, status and scale on the `kvmesh` parser."""
    up = commands.add_parser("up", help="run the whole mesh as local processes")
    up.add_argument("--model", default="smollm2-135m", help="model spec every worker loads")
    up.add_argument("--tier", default="", help="tier id clients ask for (default: from the model)")
    up.add_argument(
        "--mode",
        choices=["colocated", "disaggregated"],
        default="colocated",
        help="workers that do both prefill and decode (default: faster on one machine), or "
        "separate prefill and decode workers",
    )
    up.add_argument("--prefill", type=int, default=1, help="prefill workers (disaggregated)")
    up.add_argument(
        "--decode", type=int, default=1, help="colocated workers (or decode workers, disaggregated)"
    )
    up.add_argument(
        "--engine",
        choices=["native", "vllm"],
        default="native",
        help="every worker's engine: kvmesh's own, or vLLM (needs the kvmesh[vllm] extra)",
    )
    up.add_argument(
        "--port", type=int, default=None, help=f"gateway port (default: {GATEWAY_PORT} + offset)"
    )
    up.add_argument(
        "--http-port",
        type=int,
        default=None,
        help=f"OpenAI-compatible HTTP port (default: {OPENAI_HTTP_PORT} + offset)",
    )
    up.add_argument("--host", default="127.0.0.1", help="address every service binds")
    up.add_argument("--port-offset", type=int, default=0, help="shift every port (a second stack)")
    up.add_argument("--tenants", type=Path, default=None, help="tenants YAML for the gateway")
    up.add_argument("--redis", default="", help="Redis URL for budgets and the response cache")
    up.add_argument("--trace-file", type=Path, default=None, help="write spans as JSON lines")
    up.add_argument(
        "--mesh-auth",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate a mesh secret so the router, cache and workers take calls only from "
        "the stack's own services (--no-mesh-auth: an open mesh)",
    )
    up.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS on every hop: a local CA and a certificate per service in the state "
        "folder; clients of the gateway then pass --ca-file STATE/secrets/tls/ca.pem",
    )
    up.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="the stack's generated files and control socket (default: .kvmesh/stack-PORT, "
        "PORT the gateway's)",
    )
    up.add_argument(
        "--log-requests",
        action="store_true",
        help="the gateway logs one line per request (tenant, model, tokens, TTFT, finish)",
    )
    up.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra flag for every worker (repeatable), e.g. --worker-arg=--num-kv-blocks=256",
    )
    up.set_defaults(func=cmd_up)

    bench = commands.add_parser("bench", help="load-test a gateway (vLLM-style serving metrics)")
    add_connection_options(bench)
    bench.add_argument("--rate", type=float, default=math.inf, help="requests/s (Poisson)")
    bench.add_argument("--concurrency", type=int, default=0, help="most in flight (0: no limit)")
    bench.add_argument("--num-requests", type=int, default=100, help="requests to send")
    bench.add_argument(
        "--workload",
        choices=["random", "prefix", "mixed"],
        default="random",
        help="random prompts, prompts sharing a prefix, or both",
    )
    bench.add_argument("--input-words", type=int, default=64, help="words per prompt")
    bench.add_argument("--output-tokens", type=int, default=64, help="tokens per answer")
    bench.add_argument("--model", default="", help="model tier ('': the gateway's)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    bench.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in seconds")
    bench.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO in seconds")
    bench.add_argument("--json", type=Path, default=None, help="write the summary as JSON")
    bench.add_argument("--plot", type=Path, default=None, help="write a PNG")
    bench.set_defaults(func=cmd_bench)

    status = commands.add_parser("status", help="pools, workers, load and scaling signals")
    add_connection_options(status)
    status.add_argument(
        "--router",
        default=None,
        help=f"the router's HOST:PORT (default: the one of the `kvmesh up` whose gateway "
        f"--target names, else {DEFAULT_ROUTER})",
    )
    status.add_argument(
        "--mesh-secret-file",
        type=Path,
        default=None,
        help="the stack's mesh secret (default: the one `kvmesh up` keeps in the state folder "
        "of the stack whose gateway --target names)",
    )
    status.set_defaults(func=cmd_status)

    scale = commands.add_parser("scale", help="add or drain workers of a running `kvmesh up`")
    scale.add_argument(
        "pool", choices=["prefill", "decode", "worker", "colocated"], help="the pool to resize"
    )
    scale.add_argument("delta", type=scale_delta, help="+N to add, -N to drain")
    add_connection_options(scale)
    scale.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="the stack's up --state-dir (default: that of the stack whose gateway --target names)",
    )
    scale.set_defaults(func=cmd_scale)


def _console() -> Console:
    """A terminal's own width; piped output gets room for the whole table, not 80 columns."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def gateway_port_of(target: str) -> int:
    """The port of a HOST:PORT gateway address."""
    _, _, port = target.rpartition(":")
    if not port.isdigit():
        raise InvalidArgument("--target", f"expected HOST:PORT, got {target!r}")
    return int(port)


def target_state_dir(target: str | None) -> Path:
    """The state folder of the stack whose gateway `target` (or $KVMESH_TARGET) names."""
    return default_state_dir(gateway_port_of(resolve_target(target)))


def state_dir_of(args: argparse.Namespace) -> Path:
    """--state-dir, else the state folder of the stack whose gateway --target names."""
    if args.state_dir is not None:
        return Path(args.state_dir)
    return target_state_dir(args.target)


def cmd_up(args: argparse.Namespace) -> int:
    gateway_port = GATEWAY_PORT + args.port_offset if args.port is None else args.port
    http_port = OPENAI_HTTP_PORT + args.port_offset if args.http_port is None else args.http_port
    state_dir = args.state_dir or default_state_dir(gateway_port)
    options = StackOptions(
        model=args.model,
        tier=args.tier,
        mode=args.mode,
        prefill=args.prefill,
        decode=args.decode,
        engine=args.engine,
        gateway_port=gateway_port,
        http_port=http_port,
        tenants=args.tenants,
        redis=args.redis,
        host=args.host,
        port_offset=args.port_offset,
        state_dir=state_dir,
        log_requests=args.log_requests,
        worker_args=tuple(args.worker_arg),
        mesh_auth=args.mesh_auth,
        tls=args.tls,
    )
    trace_file = args.trace_file.resolve() if args.trace_file else None
    output = cast(TextIO, PipeSafeOutput(sys.stdout))  # a TextIOBase: what Console writes to
    return asyncio.run(run_up(options, trace_file, Console(file=output)))


def cmd_bench(args: argparse.Namespace) -> int:
    spec = LoadSpec(
        num_requests=args.num_requests,
        rate=args.rate,
        concurrency=args.concurrency,
        workload=args.workload,
        input_words=args.input_words,
        output_tokens=args.output_tokens,
        model=args.model,
        seed=args.seed,
        api_key=resolve_api_key(args.api_key),
    )
    if args.plot:
        check_plotting()  # before the run, not after it
    target = resolve_target(args.target)
    console = _console()
    columns = (TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("requests", total=spec.num_requests)

        def advance(_: RequestResult) -> None:
            progress.advance(task)

        results, duration = asyncio.run(
            run_load(target, spec, advance, resolve_ca_file(args.ca_file))
        )
    report = summarize(results, duration, Slo(args.slo_ttft, args.slo_tpot))
    console.print(summary_table(report, f"kvmesh bench → {target} ({spec.workload})"))
    for error in report["errors"]:
        console.print(f"[red]error:[/] {error}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"spec": _spec_dict(spec), **report}, indent=2))
    if args.plot:
        plot_results(results, report, args.plot)
    return 0 if report["failed"] == 0 else 1


def _spec_dict(spec: LoadSpec) -> dict[str, object]:
    return {name: getattr(spec, name) for name in spec.__slots__ if name != "api_key"}


def router_of(args: argparse.Namespace) -> str:
    """--router, else the router of the running stack whose gateway --target names."""
    if args.router:
        return str(args.router)
    recorded = read_stack_file(target_state_dir(args.target))
    return recorded["router"] if recorded else DEFAULT_ROUTER


def cmd_status(args: argparse.Namespace) -> int:
    router = router_of(args)
    state_dir = default_state_dir(gateway_port_of(resolve_target(args.target)))

    async def fetch() -> router_pb2.RouterStatusResponse:
        async with member_channel(router, operator(state_dir, args.mesh_secret_file)) as channel:
            reply: router_pb2.RouterStatusResponse = await router_pb2_grpc.RouterStub(
                channel
            ).Status(router_pb2.RouterStatusRequest(), timeout=10)
            return reply

    try:
        status = asyncio.run(fetch())
    except grpc.RpcError as error:
        raise _router_error(router, error) from None
    table = Table(title=f"kvmesh status ({router})")
    for column in ("tier", "pool", "worker", "healthy", "running", "waiting", "KV used", "tok/s"):
        table.add_column(column)
    table.add_column("recommended", justify="right")
    for pool in status.pools:
        role = worker_pb2.WorkerRole.Name(pool.role).removeprefix("WORKER_ROLE_").lower()
        for index, worker in enumerate(pool.workers):
            stats = worker.stats
            used = stats.kv_blocks_total - stats.kv_blocks_free
            table.add_row(
                pool.tier,
                role,
                worker.address,
                "yes" if worker.healthy else "NO",
                str(stats.running),
                str(stats.waiting),
                f"{used}/{stats.kv_blocks_total}",
                f"{stats.tokens_per_second:.1f}",
                str(pool.recommended_replicas) if index == 0 else "",
            )
    _console().print(table)
    return 0


def _router_error(router: str, error: grpc.RpcError) -> KvmeshError:
    """A failed Status call, said in terms of what the user typed."""
    failure = error_from_rpc(error)
    if isinstance(failure, Unavailable):
        return Unavailable(f"no router answers at {router}: is a stack running (`kvmesh up`)?")
    if isinstance(failure, Unimplemented):
        return Unimplemented(
            f"{router} is not a kvmesh router (a gateway?): --router takes the router's "
            f"address, {DEFAULT_ROUTER} for `kvmesh up`"
        )
    return failure


def scale_delta(text: str) -> int:
    """`+N` or `-N` workers, N at least 1 (argparse type)."""
    try:
        delta = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected +N or -N workers, got {text!r}") from None
    if delta == 0:
        raise argparse.ArgumentTypeError("a scale of 0 changes nothing: give +N or -N")
    return delta


def cmd_scale(args: argparse.Namespace) -> int:
    delta: int = args.delta
    request = {"op": "scale", "pool": args.pool, "delta": delta}
    console = Console()
    # A new worker loads its model before it serves (seconds to minutes): say so meanwhile.
    doing = (
        f"starting {delta} {args.pool} worker(s): loading the model"
        if delta > 0
        else (f"draining {-delta} {args.pool} worker(s): their in-flight requests finish first")
    )
    with console.status(doing):
        reply = asyncio.run(call_control(socket_path(state_dir_of(args)), request))
    if not reply.get("ok"):
        console.print(f"[bold red]scale failed:[/] {reply.get('error')}")
        return 1
    console.print(
        f"{args.pool}: {'added' if delta > 0 else 'drained'} {', '.join(reply['changed'])};"
        f" {reply['workers']} now"
    )
    return 0
