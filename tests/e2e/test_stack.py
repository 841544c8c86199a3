"""`kvmesh up` as a user runs it: the whole mesh as subprocesses with the tiny model.

Requests go through the CLI and the SDK and must return the engine's own tokens; the trace
file must hold one trace per request spanning all five processes; the metrics ports must
move by the right amounts; `kvmesh scale` must add a worker that serves and drain one
without losing its in-flight requests; Ctrl-C must leave no process behind.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import Message
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from prometheus_client.parser import text_string_to_metric_families

import kvmesh
from kvmesh.channels import member_channel
from kvmesh.client import build_request
from kvmesh.mesh_auth import MeshMember, MeshRole
from kvmesh.mesh_keys import MeshKeys
from kvmesh.rpc_status import error_from_status
from kvmesh.stack import (
    FIRST_WORKER_METRICS_PORT,
    FIRST_WORKER_PORT,
    GATEWAY_METRICS_PORT,
    OPENAI_HTTP_PORT,
)
from kvmesh.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.procs import REPO_ROOT
from tests.service.worker_mesh import ManyStream

TIER = "tiny"
PROMPT = "The quick brown fox"
MAX_TOKENS = 12


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_offset() -> int:
    """A port offset under which every port a 3-worker stack uses is free."""
    # Started at a point of its own, so that suites run side by side (other checkouts on one
    # machine) rarely probe the same ranges at the same moment.
    first = 2000 + 137 * (os.getpid() % 40)
    for offset in [*range(first, 9000, 137), *range(2000, first, 137)]:
        ports = [50051 + offset + i for i in range(20)] + [9451 + offset + i for i in range(20)]
        ports.append(OPENAI_HTTP_PORT + offset)
        if all(port_free(p) for p in ports):
            return offset
    raise RuntimeError("no free port range for the stack")


@dataclass
class RunningStack:
    proc: subprocess.Popen[str]
    reader: subprocess.Popen[str]
    """What reads kvmesh up's output, as `tee` does in `kvmesh up | tee log`."""
    gateway: str
    offset: int
    cwd: Path
    """The folder kvmesh up was started in: its state lives under .kvmesh/ there."""
    spans: Path
    output: list[str] = field(default_factory=list)

    @property
    def state_dir(self) -> Path:
        """The stack's own state folder, keyed by its gateway port."""
        return self.cwd / ".kvmesh" / f"stack-{50051 + self.offset}"

    def metrics_url(self, port: int) -> str:
        return f"http://127.0.0.1:{port}/metrics"

    def worker_metrics_port(self, slot: int) -> int:
        return FIRST_WORKER_METRICS_PORT + self.offset + slot

    def kill(self) -> None:
        """Ends kvmesh up (and so its services) and its reader, if still running."""
        for process in (self.proc, self.reader):
            if process.poll() is None:
                process.kill()
                process.wait()

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvmesh.cli", *args],
            cwd=self.cwd,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    # Split workers: these tests follow a request over the prefill -> decode hand-off.
    running = start_kvmesh_up(
        tiny_llama_dir, tmp_path_factory.mktemp("stack"), "--mode", "disaggregated"
    )
    yield running
    running.kill()


def start_kvmesh_up(model: Path, state: Path, *extra: str) -> RunningStack:
    """`kvmesh up` of the tiny model (plus `extra` flags) from `state`, once it is ready."""
    offset = pick_offset()
    gateway_port = 50051 + offset  # --port-offset moves the gateway too
    spans = state / "spans.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "up",
            "--model",
            str(model),
            "--tier",
            TIER,
            "--port-offset",
            str(offset),
            "--trace-file",
            str(spans),
            "--log-requests",
            "--worker-arg=--num-kv-blocks=256",
            "--worker-arg=--num-threads=1",
            *extra,
        ],
        cwd=state,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "PYTHONUNBUFFERED": "1",
            "COLUMNS": "200",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    reader = subprocess.Popen(["cat"], stdin=proc.stdout, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.close()  # the reader alone holds the pipe, as tee does
    running = RunningStack(proc, reader, f"127.0.0.1:{gateway_port}", offset, state, spans)
    ready = threading.Event()
    became_ready: list[bool] = []

    def pump() -> None:
        assert reader.stdout is not None
        for line in reader.stdout:
            running.output.append(line)
            if "gateway ready at" in line:
                became_ready.append(True)
                ready.set()
        ready.set()  # the output ended: kvmesh up stopped, ready or not

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(240) or not became_ready or proc.poll() is not None:
        proc.kill()
        pytest.fail("kvmesh up did not become ready:\n" + "".join(running.output[-60:]))
    return running


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples: dict[Any, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


def expected_tokens(model_dir: Path, prompt: str) -> list[int]:
    from services.worker.engine.api import SamplingParams
    from services.worker.engine.llm import LLM

    [completion] = LLM(model=str(model_dir)).generate(
        [prompt], SamplingParams(max_tokens=MAX_TOKENS)
    )
    return list(completion.token_ids)


def test_cli_and_sdk_return_the_engines_tokens(stack: RunningStack, tiny_llama_dir: Path) -> None:
    reply = stack.cli(
        "generate", "--target", stack.gateway, "--json", "--max-tokens", str(MAX_TOKENS), PROMPT
    )
    assert reply.returncode == 0, reply.stderr
    answer = json.loads(reply.stdout)
    assert answer["token_ids"] == expected_tokens(tiny_llama_dir, PROMPT)
    assert answer["model"] == TIER
    other = "Paged attention stores"
    with kvmesh.SyncClient(stack.gateway) as client:
        result = client.generate(other, max_tokens=MAX_TOKENS, cache_policy="bypass")
    assert result.token_ids == expected_tokens(tiny_llama_dir, other)
    assert result.finish_reason in ("stop", "length")


def test_the_gateway_logs_one_line_per_request(stack: RunningStack) -> None:
    """kvmesh up --log-requests: who, which model, how many tokens, how fast, how it ended."""
    with kvmesh.SyncClient(stack.gateway) as client:
        result = client.generate("Logged once", max_tokens=5, cache_policy="bypass")

    def logged() -> list[str]:
        return [line for line in stack.output if f"request {result.request_id} " in line]

    deadline = time.monotonic() + 10
    while not logged() and time.monotonic() < deadline:
        time.sleep(0.05)
    [line] = logged()
    assert "gateway |" in line and "kvmesh.requests" in line
    assert f"model={TIER} " in line and f"completion_tokens={len(result.token_ids)} " in line
    assert f"finish={result.finish_reason}" in line and "ttft_ms=" in line


def test_the_openai_door_returns_the_engines_tokens(
    stack: RunningStack, tiny_llama_dir: Path
) -> None:
    door = f"http://127.0.0.1:{OPENAI_HTTP_PORT + stack.offset}/v1"
    assert door in "".join(stack.output), "kvmesh up prints the door's address"
    client = openai.OpenAI(base_url=door, api_key="local", max_retries=0)
    other = "Continuous batching refills"
    reply = client.completions.create(
        model=TIER, prompt=other, max_tokens=MAX_TOKENS, temperature=0, logprobs=0
    )
    assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.tokens
    ids = [int(name.removeprefix("token_id:")) for name in reply.choices[0].logprobs.tokens]
    assert ids == expected_tokens(tiny_llama_dir, other)
    assert reply.model == TIER


def test_metrics_move_by_the_right_amounts(stack: RunningStack) -> None:
    gateway_url = stack.metrics_url(GATEWAY_METRICS_PORT + stack.offset)
    decode_url = stack.metrics_url(stack.worker_metrics_port(1))
    before_gateway, before_decode = scrape(gateway_url), scrape(decode_url)
    with kvmesh.SyncClient(stack.gateway) as client:
        result = client.generate(
            "Continuous batching", max_tokens=MAX_TOKENS, ignore_eos=True, cache_policy="bypass"
        )
    assert len(result.token_ids) == MAX_TOKENS
    after_gateway, after_decode = scrape(gateway_url), scrape(decode_url)

    def moved(before: dict[Any, float], after: dict[Any, float], name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert moved(before_gateway, after_gateway, "kvmesh:request_success_total", model=TIER) == 1
    completion = moved(
        before_gateway, after_gateway, "kvmesh:tenant_tokens_total", kind="completion"
    )
    assert completion == MAX_TOKENS
    prompt = moved(before_gateway, after_gateway, "kvmesh:tenant_tokens_total", kind="prompt")
    assert prompt == result.usage.prompt_tokens
    ttft = moved(before_gateway, after_gateway, "kvmesh:time_to_first_token_seconds_count")
    assert ttft == 1
    # The decode worker's Decode stream carries every token, the prefill's first one included.
    decoded = moved(before_decode, after_decode, "kvmesh:generation_tokens_total", rpc="Decode")
    assert decoded == MAX_TOKENS


def load_spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_one_trace_per_request_across_all_five_processes(stack: RunningStack) -> None:
    with kvmesh.SyncClient(stack.gateway) as client:
        result = client.generate("Numbers: 0 1 2", max_tokens=MAX_TOKENS)  # a cache miss
    time.sleep(1.0)  # server spans end as their RPCs close
    spans = load_spans(stack.spans)
    traces = {
        s["context"]["trace_id"]
        for s in spans
        if s["attributes"].get("kvmesh.request_id") == result.request_id
    }
    assert len(traces) == 1, f"request {result.request_id} spread over {len(traces)} traces"
    trace = [s for s in spans if s["context"]["trace_id"] in traces]
    processes: dict[str, set[str]] = defaultdict(set)
    for span in trace:
        resource = span["resource"]["attributes"]
        processes[resource["service.name"]].add(resource["service.instance.id"])
    assert set(processes) == {"admission", "cache", "router", "worker"}
    assert len(processes["worker"]) == 2, "the prefill and the decode worker both report"
    ids = {s["context"]["span_id"] for s in trace}
    roots = [s for s in trace if not s.get("parent_id")]
    assert len(roots) == 1 and roots[0]["name"] == "/kvmesh.v1.Gateway/Generate"
    assert all(s["parent_id"] in ids for s in trace if s.get("parent_id"))
    names = {s["name"] for s in trace}
    assert {"/kvmesh.v1.Worker/Prefill", "/kvmesh.v1.Worker/PullKv"} <= names
    generation = next(s for s in trace if "gen_ai.usage.output_tokens" in s["attributes"])
    assert generation["attributes"]["gen_ai.request.model"] == TIER


def test_the_sdks_concurrent_streams_share_one_generate_many_call(
    stack: RunningStack, tiny_llama_dir: Path
) -> None:
    prompts = [f"Count with me: {i}, {i + 1}," for i in range(4)]

    async def together() -> list[kvmesh.GenerationResult]:
        async with kvmesh.Client(stack.gateway) as client:
            answers = (
                client.generate(p, max_tokens=MAX_TOKENS, cache_policy="bypass") for p in prompts
            )
            return await asyncio.gather(*answers)

    def gateway_calls() -> int:
        time.sleep(1.0)  # server spans end as their RPCs close
        return sum(s["name"] == "/kvmesh.v1.Gateway/GenerateMany" for s in load_spans(stack.spans))

    before = gateway_calls()
    results = asyncio.run(together())
    assert [r.token_ids for r in results] == [expected_tokens(tiny_llama_dir, p) for p in prompts]
    assert gateway_calls() == before + 1


def test_a_dropped_sdk_stream_cancels_its_request(stack: RunningStack) -> None:
    dropped = "cancelled by the caller: the client dropped the stream"

    def cancels_seen() -> int:
        return sum(dropped in line for line in list(stack.output))

    async def drop_a_running_stream() -> None:
        async with kvmesh.Client(stack.gateway) as client:
            stream = client.stream(PROMPT, max_tokens=400, ignore_eos=True, cache_policy="bypass")
            await anext(stream)  # running: its first tokens are out
            del stream  # nothing refers to it any more: no close, no cancel
            gc.collect()
            # The gateway receives the stream's Cancel (the tiny model may have finished the
            # answer by then: the Cancel is sent all the same, and the gateway logs it).
            for _ in range(100):
                if cancels_seen() > already:
                    return
                await asyncio.sleep(0.1)

    already = cancels_seen()
    asyncio.run(drop_a_running_stream())
    assert cancels_seen() == already + 1


def test_the_gateways_generate_many_fails_a_bad_message_alone_and_cancels_by_number(
    stack: RunningStack,
) -> None:
    long_answer = build_request(PROMPT, max_tokens=400, ignore_eos=True, cache_policy="bypass")

    async def run() -> ManyStream:
        async with grpc.aio.insecure_channel(stack.gateway) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            stream = ManyStream(stub.GenerateMany, gateway_pb2.GenerateManyClientMessage)
            stream.send(1)  # neither a request nor a cancel
            stream.send(2, request=build_request(PROMPT, model="no-such-tier"))
            stream.send(3, request=long_answer)
            stream.send(4, request=build_request(PROMPT, max_tokens=MAX_TOKENS))
            await stream.read_until({1, 2, 4})
            assert 3 not in stream.ended
            stream.send(3, cancel=common_pb2.Cancel(reason="the test is done with it"))
            await stream.read_until({3})
            stream.half_close()
            assert await stream.call.code() == grpc.StatusCode.OK
            return stream

    stream = asyncio.run(run())
    failures = {i: error_from_status(s) for i, s in stream.errors.items()}
    assert {i: e.status for i, e in failures.items()} == dict.fromkeys((1, 2), "INVALID_ARGUMENT")
    assert "no-such-tier" in str(failures[2])
    assert stream.finish_reason(3) == common_pb2.FINISH_REASON_ABORT
    assert len(stream.token_ids(3)) < 400
    assert stream.finish_reason(4) in (
        common_pb2.FINISH_REASON_LENGTH,
        common_pb2.FINISH_REASON_STOP,
    )
    assert stream.events[4][0].started.model == TIER


def test_status_and_the_scaling_signal(stack: RunningStack) -> None:
    router = f"127.0.0.1:{50052 + stack.offset}"
    recorded = json.loads((stack.state_dir / "stack.json").read_text())
    assert recorded == {"gateway": stack.gateway, "router": router}
    reply = stack.cli("status", "--target", stack.gateway)  # the stack found by its gateway
    assert reply.returncode == 0, reply.stderr
    assert f"kvmesh status ({router})" in reply.stdout
    assert "prefill" in reply.stdout and "decode" in reply.stdout
    samples = scrape(stack.metrics_url(9452 + stack.offset))
    # An idle pool needs its minimum of one replica (the default warm buffer is 0).
    for pool in ("prefill", "decode"):
        assert metric(samples, "kvmesh:router_recommended_replicas", tier=TIER, pool=pool) == 1
        assert metric(samples, "kvmesh:router_workers_in_rotation", tier=TIER, pool=pool) == 1


def test_internal_ports_refuse_callers_outside_the_stack(stack: RunningStack) -> None:
    """kvmesh up generates a mesh secret: a direct call to the router, the cache or a worker,
    without it, is refused (issue 15.2); the stack keeps serving (the other tests)."""
    secret = stack.state_dir / "secrets" / "mesh-secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    outsider = MeshMember(MeshRole.OPERATOR, "operator", MeshKeys.from_secret("a guess"))

    async def refusals() -> list[grpc.StatusCode]:
        codes = []
        for port, call in (
            (
                50052,
                lambda ch: router_pb2_grpc.RouterStub(ch).AddWorker(
                    router_pb2.AddWorkerRequest(tier=TIER, address="127.0.0.1:9")
                ),
            ),
            (
                50052,
                lambda ch: router_pb2_grpc.RouterStub(ch).RemoveWorker(
                    router_pb2.RemoveWorkerRequest(address=f"127.0.0.1:{50061 + stack.offset}")
                ),
            ),
            (
                50053,
                lambda ch: cache_pb2_grpc.CacheStub(ch).Invalidate(
                    cache_pb2.InvalidateRequest(all=True)
                ),
            ),
            (50061, lambda ch: worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest())),
        ):
            for member in (None, outsider):
                address = f"127.0.0.1:{port + stack.offset}"
                async with member_channel(address, member) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as raised:
                        await call(channel)
                    codes.append(raised.value.code())
        return codes

    assert set(asyncio.run(refusals())) == {grpc.StatusCode.UNAUTHENTICATED}


async def stream_tokens(
    target: str, max_tokens: int, started: asyncio.Event
) -> kvmesh.client.GenerationResult:
    async with kvmesh.Client(target) as client:
        stream = client.stream(
            "Unicode: café", max_tokens=max_tokens, ignore_eos=True, cache_policy="bypass"
        )
        async with stream:
            async for _ in stream:
                started.set()
            return stream.result


async def concurrent_streams(target: str, count: int, max_tokens: int) -> list[Any]:
    started = asyncio.Event()
    tasks = [asyncio.create_task(stream_tokens(target, max_tokens, started)) for _ in range(count)]
    return await asyncio.gather(*tasks)


def test_scale_up_adds_a_decode_worker_that_serves(stack: RunningStack) -> None:
    reply = stack.cli("scale", "decode", "+1", "--target", stack.gateway, timeout=180)
    assert reply.returncode == 0, reply.stdout + reply.stderr
    new_address = f"127.0.0.1:{FIRST_WORKER_PORT + stack.offset + 2}"
    assert new_address in reply.stdout
    # The reply comes once the router routes to the newcomer, not merely once it started.
    status = stack.cli("status", "--target", stack.gateway)
    row = next(line for line in status.stdout.splitlines() if new_address in line)
    assert "yes" in row.split(), status.stdout
    new_metrics = stack.metrics_url(stack.worker_metrics_port(2))
    before = metric(scrape(new_metrics), "kvmesh:generation_tokens_total")
    results = asyncio.run(concurrent_streams(stack.gateway, count=4, max_tokens=MAX_TOKENS))
    assert all(len(r.token_ids) == MAX_TOKENS for r in results)
    assert metric(scrape(new_metrics), "kvmesh:generation_tokens_total") > before


def test_draining_a_worker_lets_its_in_flight_requests_finish(stack: RunningStack) -> None:
    max_tokens = 160

    async def drain_during_streams() -> list[Any]:
        started = asyncio.Event()
        tasks = [
            asyncio.create_task(stream_tokens(stack.gateway, max_tokens, started)) for _ in range(4)
        ]
        await asyncio.wait_for(started.wait(), 60)
        drained = await asyncio.to_thread(
            stack.cli, "scale", "decode", "-1", "--target", stack.gateway
        )
        assert drained.returncode == 0, drained.stdout + drained.stderr
        return await asyncio.gather(*tasks)

    results = asyncio.run(drain_during_streams())
    assert [len(r.token_ids) for r in results] == [max_tokens] * 4
    assert {r.finish_reason for r in results} == {"length"}
    assert any(str(FIRST_WORKER_PORT + stack.offset + 2) in r.placement_reason for r in results), (
        "no request ran on the drained worker"
    )


def test_a_pool_scales_up_and_back_down_again_and_again(stack: RunningStack) -> None:
    router_metrics = stack.metrics_url(9452 + stack.offset)

    def in_rotation() -> float:
        samples = scrape(router_metrics)
        return metric(samples, "kvmesh:router_workers_in_rotation", tier=TIER, pool="decode")

    # The pool's size comes from each scale reply ("... N now"), not from the gauge before
    # the first step: right after an earlier test drained a worker, the router may still count
    # it in rotation for a health-check interval.
    sizes = []
    for step in ("+1", "-1", "+1", "-1"):
        reply = stack.cli("scale", "decode", step, "--target", stack.gateway, timeout=180)
        assert reply.returncode == 0, f"scale decode {step}: {reply.stdout}{reply.stderr}"
        found = re.search(r"(\d+) now", reply.stdout)
        assert found is not None, reply.stdout
        sizes.append(expected := int(found.group(1)))
        deadline = time.monotonic() + 10
        while in_rotation() != expected and time.monotonic() < deadline:
            time.sleep(0.1)
        assert in_rotation() == expected, f"after scale decode {step}"
        results = asyncio.run(concurrent_streams(stack.gateway, count=2, max_tokens=MAX_TOKENS))
        assert all(len(r.token_ids) == MAX_TOKENS for r in results), f"after {step}"
    up = sizes[0]
    assert sizes == [up, up - 1, up, up - 1]


def pid_listening_on(port: int) -> int:
    """The process whose command line serves gRPC on `port` (a service of the stack)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--port" in args and args[args.index(b"--port") + 1 :][:1] == [str(port).encode()]:
            return int(proc.name)
    raise AssertionError(f"nothing of the stack serves port {port}")


def test_a_killed_worker_is_restarted_and_the_stack_serves_throughout(
    stack: RunningStack,
) -> None:
    """SIGKILL of the only prefill worker: kvmesh up says so, starts it again on its port and
    the stack serves again, without stopping."""
    port = FIRST_WORKER_PORT + stack.offset
    victim = pid_listening_on(port)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while True:
        assert stack.proc.poll() is None, "kvmesh up stopped the stack"
        try:
            result = stack.cli("generate", "after the crash", "--max-tokens", "3",
                               "--target", stack.gateway)  # fmt: skip
            if result.returncode == 0 and pid_listening_on(port) != victim:
                break
        except AssertionError:
            pass  # not back yet
        assert time.monotonic() < deadline, "the killed worker did not come back"
        time.sleep(0.5)
    log = "".join(stack.output)
    assert "prefill-0 exited unexpectedly (code -9); restarting it in 1s" in log
    assert "prefill-0 restarted" in log


def readme_grpcurl_commands() -> list[list[str]]:
    """The grpcurl commands README.md shows, each split as a shell would."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("<!-- grpcurl -->", 1)[1].split("<!-- /grpcurl -->", 1)[0]
    return [shlex.split(line) for line in block.splitlines() if line.startswith("grpcurl ")]


def run_like_grpcurl(command: list[str], gateway: str) -> list[Message]:
    """What grpcurl does with `command`, done through server reflection: list services,
    describe one, or invoke a method with a JSON request. Returns the messages received
    (a list or describe answers with the descriptor it found)."""
    data = command[command.index("-d") + 1] if "-d" in command else None
    positional = [word for word in command[1:] if not word.startswith("-") and word != data]
    address, action = positional[0].replace("127.0.0.1:50051", gateway), positional[1:]
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        pool = descriptor_pool.DescriptorPool(database)
        if action == ["list"]:
            return [descriptor_pb2.ServiceDescriptorProto(name=n) for n in database.get_services()]
        if action[0] == "describe":
            found = descriptor_pb2.ServiceDescriptorProto()
            pool.FindServiceByName(action[1]).CopyToProto(found)
            return [found]
        service, method_name = action[0].rsplit("/", 1)
        method = pool.FindServiceByName(service).methods_by_name[method_name]
        request_class = message_factory.GetMessageClass(method.input_type)
        request = json_format.Parse(data or "{}", request_class())
        reply_class = message_factory.GetMessageClass(method.output_type)
        path = f"/{service}/{method_name}"
        serializers = {
            "request_serializer": type(request).SerializeToString,
            "response_deserializer": reply_class.FromString,
        }
        if method.client_streaming:
            call = channel.stream_stream(path, **serializers)
            return list(call(iter([request]), timeout=60))
        return [channel.unary_unary(path, **serializers)(request, timeout=60)]


def test_the_readme_grpcurl_commands_work_as_written(stack: RunningStack) -> None:
    commands = readme_grpcurl_commands()
    assert len(commands) == 4
    listed, described, models, generated = (run_like_grpcurl(c, stack.gateway) for c in commands)
    assert "kvmesh.v1.Gateway" in {getattr(service, "name", "") for service in listed}
    assert isinstance(described[0], descriptor_pb2.ServiceDescriptorProto)
    assert "Generate" in {method.name for method in described[0].method}
    assert TIER in json_format.MessageToJson(models[0])
    events = [json_format.MessageToDict(event) for event in generated]
    assert "started" in events[0] and "finished" in events[-1], events
    assert events[-1]["finished"]["usage"]["completionTokens"] == 8


def test_ctrl_c_stops_every_process(stack: RunningStack) -> None:
    children = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(stack.proc.pid)], capture_output=True, text=True
    ).stdout.split()
    # cache, prefill-0, decode-0, router, gateway (decode-1 drained)
    assert len(children) == 5
    assert (stack.state_dir / "control.sock").exists()
    stack.reader.kill()  # Ctrl-C on `kvmesh up | tee log` ends tee first
    stack.reader.wait()
    stack.proc.send_signal(signal.SIGINT)
    assert stack.proc.wait(timeout=90) == 0
    for pid in map(int, children):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not (stack.state_dir / "control.sock").exists()
    assert not (stack.state_dir / "stack.json").exists()
    logs = "".join(stack.output)
    assert "Traceback" not in logs, "a service logged an error:\n" + logs[-4000:]
