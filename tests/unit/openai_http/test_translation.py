"""OpenAI bodies to GenerateRequests and kvmesh errors to OpenAI errors (pure translation)."""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh.errors import InvalidArgument, KvmeshError, ResourceExhausted, Unauthenticated
from kvmesh.v1 import common_pb2
from services.openai_http import schemas, translation
from services.openai_http.translation import DoorHeaders

pytestmark = pytest.mark.unit

HEADERS = DoorHeaders(api_key="kvm_key")


def chat(**fields: Any) -> translation.Plan:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    return translation.chat_plan(schemas.ChatCompletionRequest.model_validate(body), HEADERS)


def completion(headers: DoorHeaders = HEADERS, **fields: Any) -> translation.Plan:
    body = schemas.CompletionRequest.model_validate({"model": "tiny", "prompt": "hi", **fields})
    return translation.completion_plan(body, headers, max_prompts=4)


def test_n_seeded_samples_use_consecutive_seeds_and_keys_per_choice() -> None:
    headers = DoorHeaders(api_key="k", idempotency_key="abc")
    plan = completion(headers, prompt=["a", "b"], n=2, seed=7)
    assert [r.sampling.seed for r in plan.requests] == [7, 8, 7, 8]
    assert [r.idempotency_key for r in plan.requests] == [
        "abc:0:0",
        "abc:0:1",
        "abc:1:0",
        "abc:1:1",
    ]
    assert plan.prompt_of == [0, 0, 1, 1]
    assert [plan.first_of_prompt(i) for i in range(4)] == [True, False, True, False]
    assert completion(headers).requests[0].idempotency_key == "abc"


def test_chat_fields_become_the_gateway_request() -> None:
    plan = chat(
        messages=[
            {"role": "developer", "content": "terse"},
            {"role": "user", "content": [{"type": "text", "text": t} for t in "ab"]},
        ],
        max_tokens=5, max_completion_tokens=9, stop="\n", logprobs=True, top_logprobs=3,
        user="u1", metadata={"team": "x"}, priority="batch", cache_policy="bypass",
    )  # fmt: skip
    [request] = plan.requests
    assert [(m.role, m.content) for m in request.prompt.chat.messages] == [
        ("system", "terse"),
        ("user", "ab"),
    ]
    assert request.prompt.chat.add_generation_prompt
    assert request.sampling.max_tokens == 9 and plan.max_tokens_param == "max_completion_tokens"
    assert list(request.sampling.stop) == ["\n"] and request.sampling.logprobs == 3
    assert request.sampling.temperature == translation.DEFAULT_TEMPERATURE
    assert dict(request.labels) == {"team": "x", "user": "u1"}
    assert request.priority == common_pb2.PRIORITY_BATCH
    assert request.cache_policy == common_pb2.CACHE_POLICY_BYPASS
    assert not chat().requests[0].sampling.HasField("logprobs")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"1": 2}}, "logit_bias"),
        ({"n": 9}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "x"}]}]}, "messages[0].content[0]"),
        ({"seed": -1}, "seed"),
        ({"max_tokens": 2**40}, "max_tokens"),
    ],
)  # fmt: skip
def test_fields_kvmesh_cannot_honour_are_refused_by_name(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        chat(**fields)
    assert refused.value.field == param


def test_neutral_values_of_refused_fields_pass() -> None:
    chat(presence_penalty=0, response_format={"type": "text"}, tool_choice="none", best_of=1)


def test_completion_prompts_and_echo() -> None:
    assert completion(prompt=[1, 2, 3]).requests[0].prompt.token_ids.ids == [1, 2, 3]
    assert len(completion(prompt=[[1], [2]]).requests) == 2
    for fields, param in (
        ({"echo": True}, "echo"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1], []]}, "prompt[1]"),
        ({"prompt": [2**33]}, "prompt[0]"),
        ({"prompt": ["a"] * 5}, "prompt"),
        ({"suffix": "x"}, "suffix"),
    ):
        with pytest.raises(InvalidArgument) as refused:
            completion(**fields)
        assert refused.value.field == param


def test_gateway_field_names_become_the_requests_own() -> None:
    plan = chat(max_completion_tokens=4)
    assert translation.openai_param("chat", "max_completion_tokens", "sampling.max_tokens") == (
        "max_completion_tokens"
    )
    assert translation.openai_param("chat", "x", "prompt.chat.messages[2].role") == (
        "messages[2].role"
    )
    assert translation.openai_param("completion", "x", "prompt.token_ids.ids[3]") == "prompt[3]"
    assert translation.openai_param("completion", "x", "sampling.logprobs") == "logprobs"
    assert translation.openai_param("chat", "x", "labels[user]") == "user"
    error = translation.http_error(InvalidArgument("prompt", "the prompt is 600 tokens"), plan)
    assert error.status == 400 and error.body.error.param == "messages"
    assert error.body.error.message == "messages: the prompt is 600 tokens"


def test_statuses_and_retry_after() -> None:
    limited = translation.http_error(ResourceExhausted("over budget", retry_after_s=12.2))
    assert limited.status == 429 and limited.headers == {
        "retry-after": "13",
        "retry-after-ms": "12200",
    }
    assert limited.body.error.type == "rate_limit_error"
    assert translation.http_error(Unauthenticated("no key")).status == 401
    unknown = translation.http_error(InvalidArgument("model", "unknown model 'x' (available: a)"))
    assert unknown.status == 404 and unknown.body.error.code == "model_not_found"
    assert translation.http_error(KvmeshError("bug")).status == 500


def test_headers() -> None:
    parsed = DoorHeaders.parse(
        {"authorization": "Bearer kvm_x", "idempotency-key": "k", "x-kvmesh-timeout-s": "2.5"}
    )
    assert parsed == DoorHeaders("kvm_x", "k", 2.5)
    assert DoorHeaders.parse({"authorization": "Basic abc"}).api_key == ""
    for bad in ("0", "-1", "soon", "inf"):
        with pytest.raises(InvalidArgument, match="X-Kvmesh-Timeout-S"):
            DoorHeaders.parse({"x-kvmesh-timeout-s": bad})
