"""OpenAI bodies to GenerateRequests and kvmesh errors to OpenAI errors (pure translation)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh.errors import InvalidArgument, KvmeshError, ResourceExhausted, Unauthenticated
from kvmesh.v1 import common_pb2
from services.admission.openai_http import schemas, translation
from services.admission.openai_http.translation import DoorHeaders

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


WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 1}}]}]},
            "messages[0].tool_calls[0].function.name",
        ),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"1": 2}}, "logit_bias"),
        ({"n": 9}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
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


def test_response_format_becomes_the_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    strict = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    assert json.loads(chat(response_format=strict).requests[0].sampling.json_schema) == schema
    assert chat(response_format={"type": "json_object"}).requests[0].sampling.json_object
    plain = chat(response_format={"type": "text"}).requests[0].sampling
    assert plain.WhichOneof("constraint") is None
    assert completion(response_format={"type": "json_object"}).requests[0].sampling.json_object
    assert translation.openai_param("chat", "max_tokens", "sampling.json_schema") == (
        "response_format"
    )


def test_tools_tool_choice_and_tool_turns_become_the_chat_request() -> None:
    messages = [
        {"role": "user", "content": "Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    plan = chat(messages=messages, tools=[WEATHER])
    request = plan.requests[0]
    assert plan.tool_answer == "auto"
    assert request.prompt.chat.tool_choice.mode == common_pb2.TOOL_CHOICE_MODE_AUTO
    (tool,) = request.prompt.chat.tools
    assert (tool.name, tool.description) == ("weather", "the weather")
    assert json.loads(tool.parameters_json_schema) == WEATHER["function"]["parameters"]
    call_turn, tool_turn = request.prompt.chat.messages[1:]
    assert call_turn.tool_calls[0].name == "weather" and call_turn.tool_calls[0].id == "call_1"
    assert (tool_turn.role, tool_turn.tool_call_id, tool_turn.content) == (
        "tool",
        "call_1",
        "sunny",
    )
    named = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}})
    assert named.tool_answer == "call"
    assert named.requests[0].prompt.chat.tool_choice.name == "weather"
    assert chat(tools=[WEATHER], tool_choice="required").tool_answer == "call"
    assert chat(tools=[WEATHER], tool_choice="none").tool_answer == "text"
    assert translation.openai_param("chat", "max_tokens", "prompt.chat.tools[0].name") == (
        "tools[0].function.name"
    )
    assert translation.openai_param("chat", "max_tokens", "prompt.chat.tool_choice.name") == (
        "tool_choice"
    )
    with pytest.raises(InvalidArgument) as refused:
        completion(tools=[WEATHER])
    assert refused.value.field == "tools"


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
