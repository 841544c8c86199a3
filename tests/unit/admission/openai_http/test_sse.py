"""The chunks the door streams for a plan's events, as OpenAI would have sent them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.client import Chunk, GenerationResult, TokenLogprob, ToolCallInfo, UsageInfo
from kvmesh.errors import ResourceExhausted
from kvmesh.v1 import common_pb2
from services.admission.openai_http import schemas, translation
from services.admission.openai_http.generation import Event
from services.admission.openai_http.sse import DONE, StreamTranslator, frame
from services.admission.openai_http.translation import DoorHeaders

pytestmark = pytest.mark.unit


def plan(kind: str, **fields: Any) -> translation.Plan:
    headers = DoorHeaders(api_key="k")
    if kind == "chat":
        body = {"model": "big", "messages": [{"role": "user", "content": "hi"}], **fields}
        return translation.chat_plan(schemas.ChatCompletionRequest.model_validate(body), headers)
    request = schemas.CompletionRequest.model_validate({"model": "big", "prompt": "hi", **fields})
    return translation.completion_plan(request, headers, max_prompts=4)


def result(choice: int, reason: str = "length", fallback: bool = True) -> GenerationResult:
    usage = UsageInfo(prompt_tokens=5, cached_prompt_tokens=4, completion_tokens=2, cost_usd=0.5)
    return GenerationResult(
        text="ab", token_ids=[1, 2], finish_reason=reason, model="small",
        request_id=f"r{choice}", usage=usage, fallback=fallback,
    )  # fmt: skip


def decode(frame: bytes) -> dict[str, Any]:
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    parsed: dict[str, Any] = json.loads(frame[6:])
    return parsed


def test_chat_chunks_of_a_fallback_with_usage() -> None:
    stream = plan("chat", stream=True, stream_options={"include_usage": True}, logprobs=True)
    translator = StreamTranslator(stream)
    started = common_pb2.Started(request_id="r0", model="small")
    [role] = translator.frames(Event(0, started=started))
    chunk = Chunk("ab", (1, 2), (TokenLogprob(1, -0.5, ((3, -1.0),)), TokenLogprob(2, -0.1)))
    [content] = translator.frames(Event(0, chunk=chunk))
    assert translator.frames(Event(0, chunk=Chunk("", (9,)))) == []  # half a character
    [finish] = translator.frames(Event(0, result=result(0, reason="deadline")))
    role_body, content_body, finish_body = decode(role), decode(content), decode(finish)
    assert role_body["id"] == "chatcmpl-r0" and role_body["model"] == "small"
    assert role_body["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role_body["usage"] is None and "kvmesh" not in role_body
    assert content_body["choices"][0]["delta"] == {"content": "ab"}
    tokens = content_body["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in tokens] == ["token_id:1", "token_id:2"]
    assert tokens[0]["top_logprobs"] == [{"token": "token_id:3", "logprob": -1.0, "bytes": None}]
    choice = finish_body["choices"][0]
    assert choice["delta"] == {} and choice["finish_reason"] == "length"
    assert choice["kvmesh_finish_reason"] == "deadline"
    assert finish_body["kvmesh"] == {
        "requested_model": "big",
        "fallback": True,
        "request_ids": ["r0"],
    }
    usage = decode(translator.usage_frame())
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 4
    }
    assert usage["usage"]["total_tokens"] == 7 and usage["usage"]["cost_usd"] == 0.5


def test_completion_chunks_without_usage_and_an_error_mid_stream() -> None:
    stream = plan("completion", stream=True, n=2)
    translator = StreamTranslator(stream)
    assert translator.frames(Event(0, started=common_pb2.Started(request_id="r0", model="s"))) == []
    [text] = translator.frames(Event(0, chunk=Chunk("ab", (1, 2))))
    body = decode(text)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "ab"
    assert "usage" not in body and "kvmesh" not in body
    [error] = translator.frames(Event(1, error=ResourceExhausted("busy", retry_after_s=1.0)))
    assert decode(error)["error"]["type"] == "rate_limit_error"
    assert DONE == b"data: [DONE]\n\n"


def test_whole_responses_count_each_prompt_once() -> None:
    whole = plan("completion", n=2, logprobs=0)
    body = translation.whole_response(
        whole, [result(0), result(1, fallback=False)], [[0, 1], [0, 0]]
    )
    assert isinstance(body, schemas.Completion)
    assert (
        body.model == "small" and body.kvmesh.fallback and body.kvmesh.request_ids == ["r0", "r1"]
    )
    assert body.usage.prompt_tokens == 5 and body.usage.completion_tokens == 4
    assert body.usage.cost_usd == 1.0
    assert body.choices[1].logprobs is not None and body.choices[1].logprobs.text_offset == [0, 0]


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("tool_choice", "pieces", "calls", "expected"),
    [
        # auto: the free text goes out, held back where it may be the trigger's start.
        ("auto", ["Hi <to", "ol_call>\n{}", "\n</tool_call>"], 1, ["Hi ", "TOOL"]),
        ("auto", ["a <", "b"], 0, ["a ", "<b"]),
        # required: nothing of the call is content; a cut-short call ends as its text.
        ("required", ['{"name"', ': "f"}'], 1, ["TOOL"]),
        ("required", ['{"na'], 0, ['{"na']),
    ],
)
def test_a_tool_call_streams_as_one_tool_calls_delta_and_never_as_content(
    tool_choice: str, pieces: list[str], calls: int, expected: list[str]
) -> None:
    translator = StreamTranslator(plan("chat", stream=True, tools=TOOLS, tool_choice=tool_choice))
    translator.frames(Event(0, started=common_pb2.Started(request_id="r0", model="s")))
    frames = [f for piece in pieces for f in translator.frames(Event(0, chunk=Chunk(piece, (1,))))]
    done = result(0, reason="tool_calls" if calls else "length")
    done.text = "".join(pieces)
    if calls:
        done.tool_calls = [ToolCallInfo("call_1", "f", "{}")]
    *frames_at_end, finish = translator.frames(Event(0, result=done))
    deltas = [decode(f)["choices"][0]["delta"] for f in [*frames, *frames_at_end]]
    seen = ["TOOL" if "tool_calls" in d else d["content"] for d in deltas]
    assert seen == expected
    if calls:
        (call,) = next(d["tool_calls"] for d in deltas if "tool_calls" in d)
        assert call == {
            "index": 0, "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": "{}"},
        }  # fmt: skip
    reason = decode(finish)["choices"][0]["finish_reason"]
    assert reason == ("tool_calls" if calls else "length")


@pytest.mark.parametrize("kind", ["chat", "completion"])
@given(text=st.text(min_size=1))
def test_a_content_chunk_has_the_bytes_pydantic_writes(kind: str, text: str) -> None:
    """The per-choice frame around the text (written once) gives the bytes of the chunk model,
    for any text: quotes, backslashes, control characters, non-ASCII."""
    translator = StreamTranslator(plan(kind, stream=True, stream_options={"include_usage": True}))
    translator.frames(Event(0, started=common_pb2.Started(request_id="r0", model="s")))
    [sent] = translator.frames(Event(0, chunk=Chunk(text, (1,))))
    if kind == "chat":
        choice: Any = schemas.ChatChunkChoice(index=0, delta=schemas.Delta(content=text))
        body: Any = schemas.ChatCompletionChunk(
            id="chatcmpl-r0", created=0, model="s", choices=[choice]
        )
    else:
        choice = schemas.CompletionChunkChoice(index=0, text=text)
        body = schemas.CompletionChunk(id="cmpl-r0", created=0, model="s", choices=[choice])
    body.created = translator._plan.created
    exclude = {"kvmesh": True, "choices": {"__all__": {"kvmesh_finish_reason"}}}
    assert sent == frame(body, exclude)
