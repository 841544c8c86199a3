"""The gateway's OpenAI HTTP door, with a real router, cache and worker (subprocesses).

One mesh per module on the tiny random Llama: a colocated worker, the router, the response
cache, and a gateway with a tenants file serving the door; a second tier, `caller`, is the tiny
model that always wants to call a tool (tests/conftest.py) on a worker whose grammar backend is
llguidance, so tool_choice auto meets its trigger and both backends serve through the mesh.
The official `openai` SDK and raw httpx talk to the door; the kvmesh SDK talks to the same
gateway over gRPC, and both must agree token for token.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmesh
from kvmesh.healthcheck import main as healthcheck
from kvmesh.tenants import PriorityClass, Tenant, add_tenant
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from tests.procs import ServiceProcess, start_service
from tests.service.worker_mesh import KV_BLOCKS, worker_args

pytestmark = pytest.mark.e2e

TIER = "tiny"
CALLER = "caller"
LONG_PROMPT = "Numbers: 0 1 2"
"""A prompt the tiny model continues for hundreds of tokens (ignore_eos makes sure)."""
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"cache_policy": "bypass"}}


@dataclass
class Mesh:
    worker: ServiceProcess
    caller: ServiceProcess
    gateway: ServiceProcess
    keys: dict[str, str]

    @property
    def door(self) -> str:
        """host:port of the gateway's HTTP door."""
        return self.gateway.http_address

    @property
    def base_url(self) -> str:
        return f"http://{self.door}/v1"

    def openai(self, tenant: str = "alice", **options: Any) -> openai.OpenAI:
        key = self.keys.get(tenant, tenant)
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, **options)

    def grpc_client(self, tenant: str = "alice") -> kvmesh.SyncClient:
        return kvmesh.SyncClient(self.gateway.address, api_key=self.keys[tenant])

    def headers(self, tenant: str = "alice") -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[tenant]}"}


@pytest.fixture(scope="module")
def mesh(
    tiny_llama_dir: Path, tiny_tool_caller_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    state = tmp_path_factory.mktemp("openai_mesh")
    started: list[ServiceProcess] = []
    try:
        worker = start_service(
            "services.worker", worker_args(tiny_llama_dir, "colocated", "--tier", TIER)
        )
        started.append(worker)
        caller_flags = ("--tier", CALLER, "--grammar-backend", "llguidance")
        caller = start_service(
            "services.worker", worker_args(tiny_tool_caller_dir, "colocated", *caller_flags)
        )
        started.append(caller)
        pools = state / "pools.yaml"
        tiers = [
            {"name": name, "base_model": name, "colocated": [process.address]}
            for name, process in ((TIER, worker), (CALLER, caller))
        ]
        pools.write_text(yaml.safe_dump({"tiers": tiers}))
        router = start_service(
            "services.router", ["--config", str(pools), "--port", "0", "--metrics-port", "-1"]
        )
        started.append(router)
        cache = start_service("services.cache", ["--port", "0", "--metrics-port", "-1"])
        started.append(cache)
        tenants = state / "tenants.yaml"
        specs = [
            Tenant(name="alice", key_sha256=""),
            Tenant(name="limited", key_sha256="", tokens_per_minute=60),
            Tenant(name="batcher", key_sha256="", highest_priority=PriorityClass.BATCH),
        ]
        keys = {spec.name: add_tenant(tenants, spec)[1] for spec in specs}
        gateway = start_service(
            "services.admission",
            [
                "--router",
                router.address,
                "--cache",
                cache.address,
                "--model-path",
                f"{TIER}={tiny_llama_dir},{CALLER}={tiny_tool_caller_dir}",
                "--tenants",
                str(tenants),
                "--port",
                "0",
                "--metrics-port",
                "0",
                "--http-port",
                "0",
            ],
        )
        started.append(gateway)
        running = Mesh(worker, caller, gateway, keys)
        wait_until_served(running)
        yield running
    finally:
        for process in reversed(started):
            process.terminate()


def wait_until_served(mesh: Mesh, timeout: float = 60.0) -> None:
    """Until the router has the worker in rotation and a request goes through the door."""
    deadline = time.monotonic() + timeout
    client = mesh.openai()
    while True:
        try:
            for tier in (TIER, CALLER):
                client.completions.create(model=tier, prompt="warm up", max_tokens=1, **GREEDY)
            return
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def worker_stats(mesh: Mesh) -> worker_pb2.WorkerStats:
    with grpc.insecure_channel(mesh.worker.address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5)


def wait_until_idle(mesh: Mesh, within_s: float) -> None:
    """Every KV block free and nothing running within `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while (stats := worker_stats(mesh)).running or stats.kv_blocks_free < KV_BLOCKS:
        assert time.monotonic() < deadline, f"request still on the worker: {stats}"
        time.sleep(0.02)


def token_ids(names: list[str]) -> list[int]:
    """Token ids from the door's logprob token names ("token_id:N")."""
    return [int(name.removeprefix("token_id:")) for name in names]


def sse_events(raw: str) -> list[str]:
    """The data of each SSE event; asserts the framing (one data line, blank line after)."""
    assert raw.endswith("\n\n"), raw[-40:]
    events = []
    for block in raw.removesuffix("\n\n").split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        events.append(block.removeprefix("data: "))
    return events


# --- the same tokens as the gRPC door --------------------------------------------------------


def test_chat_streamed_and_not_gives_the_grpc_tokens(mesh: Mesh) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "You are terse."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "The quick "},
                {"type": "text", "text": "brown fox"},
            ],
        },
    ]
    chat = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "The quick brown fox"},
    ]
    with mesh.grpc_client() as grpc_client:
        expected = grpc_client.generate(
            chat, max_tokens=10, temperature=0, ignore_eos=True, cache_policy="bypass"
        )
    client = mesh.openai()
    whole = client.chat.completions.create(
        model=TIER,
        messages=messages,
        max_completion_tokens=10,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
        extra_body={"cache_policy": "bypass", "ignore_eos": True},
    )
    [choice] = whole.choices
    assert choice.message.content == expected.text and choice.message.role == "assistant"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert token_ids([t.token for t in choice.logprobs.content]) == expected.token_ids
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert choice.finish_reason == "length" and whole.model == TIER
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == expected.usage.prompt_tokens
    assert whole.usage.completion_tokens == 10 == len(expected.token_ids)
    assert whole.usage.total_tokens == expected.usage.prompt_tokens + 10
    extra = whole.model_extra or {}
    assert extra["kvmesh"]["requested_model"] == TIER and extra["kvmesh"]["fallback"] is False

    stream = client.chat.completions.create(
        model=TIER,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"cache_policy": "bypass", "ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == expected.usage.prompt_tokens


def test_completions_streamed_and_not_give_the_grpc_tokens(mesh: Mesh) -> None:
    with mesh.grpc_client() as grpc_client:
        expected = grpc_client.generate(
            "The quick brown fox", max_tokens=8, temperature=0, cache_policy="bypass"
        )
        from_ids = grpc_client.generate(
            [5, 6, 7, 8], max_tokens=4, temperature=0, cache_policy="bypass"
        )
    client = mesh.openai()
    whole = client.completions.create(
        model=TIER, prompt="The quick brown fox", max_tokens=8, logprobs=0, **GREEDY
    )
    [choice] = whole.choices
    assert choice.text == expected.text
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert token_ids(choice.logprobs.tokens) == expected.token_ids
    assert whole.usage is not None and whole.usage.completion_tokens == len(expected.token_ids)
    streamed = client.completions.create(
        model=TIER, prompt="The quick brown fox", max_tokens=8, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text
    batch = client.completions.create(
        model=TIER, prompt=["The quick brown fox", "Paged attention"], max_tokens=8, **GREEDY
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == expected.text
    ids = client.completions.create(model=TIER, prompt=[5, 6, 7, 8], max_tokens=4, **GREEDY)
    assert ids.choices[0].text == from_ids.text
    assert ids.usage is not None and ids.usage.prompt_tokens == 4


def test_n_samples_with_a_seed_are_reproducible(mesh: Mesh) -> None:
    client = mesh.openai()
    request: dict[str, Any] = {
        "model": TIER,
        "messages": [{"role": "user", "content": "Paged attention"}],
        "max_tokens": 8,
        "n": 3,
        "seed": 7,
        "temperature": 1.0,
        "extra_body": {"cache_policy": "bypass", "ignore_eos": True},
    }
    first = client.chat.completions.create(**request)
    again = client.chat.completions.create(**request)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1, texts
    assert first.usage is not None and first.usage.completion_tokens == 24
    streamed = client.chat.completions.create(**request, stream=True)
    by_choice: dict[int, str] = {}
    for chunk in streamed:
        for choice in chunk.choices:
            by_choice[choice.index] = by_choice.get(choice.index, "") + (choice.delta.content or "")
    assert [by_choice[i] for i in range(3)] == texts


def test_a_repeated_prompt_reports_cached_tokens_and_cache_hits(mesh: Mesh) -> None:
    client = mesh.openai()
    prompt = f"Continuous batching refills finished slots {uuid.uuid4().hex[:6]}"
    first = client.completions.create(model=TIER, prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model=TIER, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage is not None and again.usage is not None
    assert (first.usage.model_extra or {})["response_cache_hit"] is False
    assert (again.usage.model_extra or {})["response_cache_hit"] is True
    assert again.choices[0].text == first.choices[0].text
    fresh = client.completions.create(model=TIER, prompt=prompt + " more", max_tokens=2, **GREEDY)
    assert fresh.usage is not None and fresh.usage.prompt_tokens_details is not None
    assert fresh.usage.prompt_tokens_details.cached_tokens > 0


def test_list_models_health_and_metrics(mesh: Mesh) -> None:
    assert healthcheck(["--http", mesh.door]) == 0
    metrics = httpx.get(f"http://127.0.0.1:{mesh.gateway.metrics_port}/metrics").text
    assert 'kvmesh:http_responses_total{route="/v1/completions",status="200"}' in metrics
    models = {model.id: model for model in mesh.openai().models.list().data}
    assert sorted(models) == sorted([TIER, CALLER])
    assert (models[TIER].model_extra or {})["max_model_len"] == 512


# --- errors ----------------------------------------------------------------------------------


def test_errors_raise_the_sdks_exceptions(mesh: Mesh) -> None:
    chat: dict[str, Any] = {
        "model": TIER,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }
    with pytest.raises(openai.AuthenticationError):
        mesh.openai("kvm_wrong").chat.completions.create(**chat)
    client = mesh.openai()
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(**{**chat, "model": "no-such-model"})
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as long_prompt:
        client.chat.completions.create(
            **{**chat, "messages": [{"role": "user", "content": "x " * 600}]}
        )
    assert long_prompt.value.param == "messages" and "512" in long_prompt.value.message
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=TIER, prompt="hi", max_tokens=600)
    assert too_long.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as tools:
        client.chat.completions.create(
            **chat, tools=[{"type": "function", "function": {"name": "f f", "parameters": {}}}]
        )
    assert tools.value.param == "tools[0].function.name"
    with pytest.raises(openai.BadRequestError) as schema:
        client.chat.completions.create(
            **chat,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strnig"}},
            },
        )
    assert schema.value.param == "response_format"
    with pytest.raises(openai.BadRequestError) as echo:
        client.completions.create(model=TIER, prompt="hi", max_tokens=2, echo=True)
    assert echo.value.param == "echo"
    with pytest.raises(openai.BadRequestError) as image:
        client.chat.completions.create(
            **{
                **chat,
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ],
            }
        )
    assert image.value.param == "messages[0].content[0]"
    with pytest.raises(openai.BadRequestError) as ids:
        client.completions.create(model=TIER, prompt=[[5, 6], [7, -1]], max_tokens=2)
    assert ids.value.param == "prompt[1][1]"
    with pytest.raises(openai.BadRequestError) as n:
        client.chat.completions.create(**chat, n=9)
    assert n.value.param == "n"
    with pytest.raises(openai.PermissionDeniedError) as denied:
        mesh.openai("batcher").chat.completions.create(**chat)
    assert "interactive" in denied.value.message
    batch = mesh.openai("batcher").chat.completions.create(**chat, extra_body={"priority": "batch"})
    assert batch.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.APIStatusError) as late:
        client.chat.completions.create(**chat, extra_headers={"X-Kvmesh-Timeout-S": "0.001"})
    assert late.value.status_code == 504 and late.value.type == "timeout"
    # Unknown fields are ignored, as OpenAI's API ignores them.
    ok = client.chat.completions.create(**chat, extra_body={"no_such_field": 1})
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_a_gateway_whose_router_is_down_answers_503_and_its_door_says_its_health() -> None:
    gateway = start_service(
        "services.admission",
        ["--router", "127.0.0.1:1", "--port", "0", "--metrics-port", "-1", "--http-port", "0"],
    )
    try:
        # The door's /health is the gateway's own gRPC health, which its router does not change.
        assert healthcheck(["--http", gateway.http_address]) == healthcheck([gateway.address])
        client = openai.OpenAI(
            base_url=f"http://{gateway.http_address}/v1", api_key="k", max_retries=0
        )
        with pytest.raises(openai.APIStatusError) as down:
            client.completions.create(model=TIER, prompt="hi", max_tokens=2)
        assert down.value.status_code == 503
    finally:
        gateway.terminate()


def test_an_exhausted_budget_is_a_rate_limit_error_with_retry_after(mesh: Mesh) -> None:
    into_minute = time.time() % 60
    if into_minute > 50:  # budgets count per clock minute: stay well inside one
        time.sleep(60 - into_minute + 0.1)
    client = mesh.openai("limited")
    request: dict[str, Any] = {
        "model": TIER,
        "prompt": LONG_PROMPT,
        "max_tokens": 40,
        "temperature": 0,
        "extra_body": {"cache_policy": "bypass", "ignore_eos": True},
    }
    client.completions.create(**request)
    with pytest.raises(openai.RateLimitError) as limited:
        client.completions.create(**request)
    retry_after = int(limited.value.response.headers["retry-after"])
    assert 1 <= retry_after <= 60
    assert "tokens per minute" in limited.value.message


def test_a_deadline_ends_the_stream_normally_with_length(mesh: Mesh) -> None:
    client = mesh.openai()
    request: dict[str, Any] = {
        "model": TIER,
        "prompt": LONG_PROMPT,
        "max_tokens": 480,
        "temperature": 0,
        "extra_body": {"cache_policy": "bypass", "ignore_eos": True},
    }
    started = time.monotonic()
    client.completions.create(**request)
    whole_s = time.monotonic() - started
    for stream in (False, True):
        # Half the time the whole generation took; halved again when the machine got faster
        # meanwhile and the answer was complete before the deadline.
        deadline_s = max(0.4, whole_s / 2)
        for _ in range(4):
            reason, tokens = deadline_run(client, request, deadline_s, stream)
            if tokens < 480:
                break
            deadline_s = max(0.2, deadline_s / 2)
        assert reason == "deadline" and 0 < tokens < 480, (stream, reason, tokens)


def deadline_run(
    client: openai.OpenAI, request: dict[str, Any], deadline_s: float, stream: bool
) -> tuple[str, int]:
    """(kvmesh_finish_reason, completion tokens) of one request with that deadline; asserts
    the OpenAI finish reason is "length"."""
    headers = {"X-Kvmesh-Timeout-S": str(deadline_s)}
    if not stream:
        result = client.completions.create(**request, extra_headers=headers)
        [choice] = result.choices
        assert choice.finish_reason == "length" and result.usage is not None
        return (choice.model_extra or {})["kvmesh_finish_reason"], result.usage.completion_tokens
    options = {**request, "stream_options": {"include_usage": True}}
    chunks = list(client.completions.create(**options, stream=True, extra_headers=headers))
    [finish] = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish.choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert usage is not None
    return (finish.choices[0].model_extra or {})["kvmesh_finish_reason"], usage.completion_tokens


# --- the wire --------------------------------------------------------------------------------


def test_the_sse_bytes_are_openais(mesh: Mesh) -> None:
    body = {
        "model": TIER,
        "messages": [{"role": "user", "content": "The quick brown fox"}],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "cache_policy": "bypass",
    }
    with httpx.Client(base_url=mesh.base_url, headers=mesh.headers(), timeout=30) as http:
        with http.stream("POST", "/chat/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            raw = response.read().decode()
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
        assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
        role, *deltas, finish, usage = chunks
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert role["usage"] is None and "kvmesh" not in role
        assert all(d["choices"][0]["finish_reason"] is None for d in deltas)
        assert all(set(d["choices"][0]["delta"]) == {"content"} for d in deltas) and deltas
        assert finish["choices"][0]["delta"] == {}
        assert finish["choices"][0]["finish_reason"] == "length"
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
        assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5
        # Errors are OpenAI's body, with the status clients branch on.
        refused = http.post("/chat/completions", json={**body, "messages": []})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "messages"
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}


def test_a_client_that_disconnects_frees_every_kv_block_within_a_second(mesh: Mesh) -> None:
    wait_until_idle(mesh, 2.0)
    body = {
        "model": TIER,
        "prompt": LONG_PROMPT,
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
        "cache_policy": "bypass",
    }
    with (
        httpx.Client(base_url=mesh.base_url, headers=mesh.headers(), timeout=30) as http,
        http.stream("POST", "/completions", json={**body, "stream": True}) as response,
    ):
        lines = response.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert worker_stats(mesh).kv_blocks_free < KV_BLOCKS
    wait_until_idle(mesh, 1.0)

    async def leave_while_waiting() -> None:
        async with httpx.AsyncClient(base_url=mesh.base_url, headers=mesh.headers()) as http:
            request = asyncio.ensure_future(http.post("/completions", json=body, timeout=30))
            deadline = time.monotonic() + 10
            while not (await asyncio.to_thread(worker_stats, mesh)).running:
                assert time.monotonic() < deadline and not request.done()
                await asyncio.sleep(0.02)
            request.cancel()

    asyncio.run(leave_while_waiting())
    wait_until_idle(mesh, 1.0)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_fields = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "n",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "logprobs",
        "top_logprobs",
        "stream",
        "stream_options",
        "priority",
        "metadata",
        "echo",
    ]
)
_VALID_BASES = [
    {"model": TIER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    {"model": TIER, "prompt": "hi", "max_tokens": 2},
]
_bodies = st.one_of(
    st.binary(max_size=40),
    st.dictionaries(_fields, _json_values, max_size=5).map(lambda d: json.dumps(d).encode()),
    st.builds(
        lambda base, extra: json.dumps({**base, **extra}).encode(),
        st.sampled_from(_VALID_BASES),
        st.dictionaries(
            _fields.filter(lambda f: f not in ("model", "messages")), _json_values, max_size=2
        ),
    ),
)


def test_malformed_bodies_get_clear_400s_and_the_door_stays_healthy(mesh: Mesh) -> None:
    with httpx.Client(base_url=mesh.base_url, headers=mesh.headers(), timeout=30) as http:

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=_bodies, route=st.sampled_from(["/chat/completions", "/completions"]))
        def check(body: bytes, route: str) -> None:
            response = http.post(route, content=body, headers={"content-type": "application/json"})
            if response.status_code == 200:
                return  # a body that happened to be a valid request
            assert response.status_code in (400, 422), (response.status_code, response.text)
            error = response.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error"

        check()
        assert http.get(f"http://{mesh.door}/health").status_code == 200
    wait_until_idle(mesh, 5.0)


# --- tool calls (issue 16.8) -------------------------------------------------------------------

# Small: the tiny model's context is 512 tokens, and its tokenizer spends about one a character.
WEATHER_TOOL: dict[str, Any] = {
    "name": "weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CLOCK_TOOL: dict[str, Any] = {
    "name": "clock",
    "parameters": {
        "type": "object",
        "properties": {"h": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["h"],
    },
}
TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    t["name"]: t["parameters"] for t in (WEATHER_TOOL, CLOCK_TOOL)
}


def test_auto_tool_choice_through_the_sdk(mesh: Mesh) -> None:
    """tool_choice auto (the default with tools): the caller model writes <tool_call> first
    thing, and from there the structural tag holds it to one call of one of the tools, greedy
    and sampled: it parses and validates, finish reason tool_calls. The same model with
    tool_choice none writes <tool_call> on and on, which is no call: the constraint made the
    call. The random tiny model under auto writes free text and no call. The call and its
    result go back as assistant and tool turns and the conversation continues."""
    question = [{"role": "user", "content": f"Weather? {uuid.uuid4().hex[:6]}"}]
    tools = [WEATHER_TOOL, CLOCK_TOOL]
    with mesh.grpc_client() as client:
        greedy = client.generate(question, model=CALLER, max_tokens=60, tools=tools)
        sampled = [
            client.generate(
                question, model=CALLER, max_tokens=60, tools=tools, temperature=0.9, seed=seed
            )
            for seed in range(3)
        ]
        unconstrained = client.generate(
            question, model=CALLER, max_tokens=12, tools=tools, tool_choice="none"
        )
        free = client.generate(question, model=TIER, max_tokens=24, tools=tools)
        (call,) = greedy.tool_calls
        conversation: list[dict[str, Any]] = [
            *question,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "sunny", "tool_call_id": call.id},
        ]
        after = client.generate(conversation, model=CALLER, max_tokens=60, tools=[CLOCK_TOOL])
    for result in (greedy, *sampled, after):
        assert result.finish_reason == "tool_calls", result.text
        (made,) = result.tool_calls
        assert made.id.startswith("call_") and made.name in TOOL_SCHEMAS
        assert result.text.startswith("<tool_call>\n") and result.text.endswith("</tool_call>")
        jsonschema.validate(made.arguments, TOOL_SCHEMAS[made.name])
    assert unconstrained.text.startswith("<tool_call><tool_call>")
    assert unconstrained.finish_reason == "length" and not unconstrained.tool_calls
    assert free.finish_reason in ("length", "stop") and not free.tool_calls
    assert "<tool_call>" not in free.text and free.usage.completion_tokens > 0
    assert after.tool_calls[0].name == "clock"


def openai_tools(*tools: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": tool} for tool in tools]


def test_tools_and_tool_choice_through_the_openai_sdk(mesh: Mesh) -> None:
    """auto on the caller model: message.tool_calls holds the parsed call (content None),
    finish_reason tool_calls; streamed, no content delta shows the call's text and one
    tool_calls delta carries it whole, equal to the unstreamed call. required and a named
    function on the random tiny model: a call that validates. none: text, no call. The call
    and its result go back as an assistant turn with tool_calls and a tool turn."""
    client = mesh.openai()
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Hi {uuid.uuid4().hex[:6]}"}]
    tools = openai_tools(WEATHER_TOOL, CLOCK_TOOL)
    chat = {"messages": messages, "tools": tools, "max_tokens": 60, **GREEDY}
    auto = client.chat.completions.create(model=CALLER, **chat)
    stream = client.chat.completions.create(model=CALLER, stream=True, **chat)
    chunks = list(stream)
    required = client.chat.completions.create(model=TIER, tool_choice="required", **chat)
    named = client.chat.completions.create(
        model=TIER, tool_choice={"type": "function", "function": {"name": "clock"}}, **chat
    )
    none = client.chat.completions.create(
        model=CALLER, tool_choice="none", **{**chat, "max_tokens": 8}
    )
    for answer in (auto, required, named):
        (choice,) = answer.choices
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])
    assert (named.choices[0].message.tool_calls or [])[0].function.name == "clock"
    contents = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert not any("tool_call" in text for text in contents), contents
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    (streamed,) = deltas
    (whole,) = auto.choices[0].message.tool_calls or []
    assert streamed.index == 0 and streamed.id and streamed.type == "function"
    assert streamed.function is not None
    assert (streamed.function.name, streamed.function.arguments) == (
        whole.function.name,
        whole.function.arguments,
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert none.choices[0].message.content == "<tool_call>" * 8
    assert none.choices[0].finish_reason == "length" and not none.choices[0].message.tool_calls
    conversation: list[Any] = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [whole.model_dump()]},
        {"role": "tool", "tool_call_id": whole.id, "content": "sunny"},
    ]
    again: dict[str, Any] = {
        "messages": conversation,
        "tools": openai_tools(CLOCK_TOOL),
        "tool_choice": "none",
        "max_tokens": 4,
        **GREEDY,
    }
    after = client.chat.completions.create(model=TIER, **again)
    assert after.usage.completion_tokens > 0
    assert after.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("tier", [TIER, CALLER])
def test_response_format_through_the_openai_sdk(mesh: Mesh, tier: str) -> None:
    """json_schema (strict) on the random tiny model (its worker's grammar backend xgrammar)
    and the calling one (llguidance), json_object on the random one (the calling model would
    write <tool_call> into a free string for ever): the content is strict JSON that
    validates, streamed and not, and the two agree."""
    client = mesh.openai()
    schema = TOOL_SCHEMAS["clock"] | {"additionalProperties": False}
    strict: Any = {
        "type": "json_schema",
        "json_schema": {"name": "t", "schema": schema, "strict": True},
    }
    chat: dict[str, Any] = {
        "model": tier,
        "messages": [{"role": "user", "content": "What time?"}],
        "max_tokens": 40,
        **GREEDY,
    }
    whole = client.chat.completions.create(response_format=strict, **chat)
    streamed = client.chat.completions.create(response_format=strict, stream=True, **chat)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    content = whole.choices[0].message.content or ""
    assert whole.choices[0].finish_reason == "stop" and text == content
    jsonschema.validate(json.loads(content), schema)
    if tier == TIER:
        anything = client.chat.completions.create(response_format={"type": "json_object"}, **chat)
        assert isinstance(json.loads(anything.choices[0].message.content or ""), dict)
