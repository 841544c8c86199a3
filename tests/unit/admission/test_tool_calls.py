"""Tool definitions planned into a call schema, rendered in kvmesh's format, calls parsed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvmesh.contracts.constraints import structural_tag
from kvmesh.errors import InvalidArgument
from kvmesh.tool_format import CALL_BEGIN, CALL_END, free_text_end, split_answer
from kvmesh.v1 import common_pb2
from services.admission.tool_calls import (
    KVMESH_TAGGED_TOOLS_HEADER,
    KVMESH_TOOLS_HEADER,
    answer_calls,
    chat_turns,
    constrain_answer,
    parse_call,
    plan_tools,
    renders_natively,
    template_takes_tools,
)

ADD = common_pb2.ToolDefinition(
    name="add",
    description="a + b",
    parameters_json_schema=json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    ),
)
PING = common_pb2.ToolDefinition(name="ping")


def chat(
    mode: int, name: str = "", tools: tuple[common_pb2.ToolDefinition, ...] = (ADD, PING)
) -> common_pb2.ChatMessages:
    return common_pb2.ChatMessages(
        messages=[common_pb2.ChatMessage(role="user", content="hi")],
        tools=list(tools),
        tool_choice=common_pb2.ToolChoice(mode=mode, name=name),  # type: ignore[arg-type]
    )


def test_required_admits_a_call_of_any_tool_and_named_only_that_tool() -> None:
    required = plan_tools(chat(common_pb2.TOOL_CHOICE_MODE_REQUIRED))
    assert required is not None and required.answer_schema is not None
    schema = json.loads(required.answer_schema)
    jsonschema.validate({"name": "add", "arguments": {"a": 1}}, schema)
    jsonschema.validate({"name": "ping", "arguments": {}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", "arguments": {}}, schema)
    named = plan_tools(chat(common_pb2.TOOL_CHOICE_MODE_NAMED, "ping"))
    assert named is not None and named.answer_schema is not None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", "arguments": {"a": 1}}, json.loads(named.answer_schema))
    none = plan_tools(chat(common_pb2.TOOL_CHOICE_MODE_NONE))
    assert none is not None and none.answer_schema is None and len(none.tools) == 2


@pytest.mark.parametrize(
    ("request_chat", "field"),
    [
        (chat(common_pb2.TOOL_CHOICE_MODE_NAMED, "nope"), "prompt.chat.tool_choice.name"),
        (chat(common_pb2.TOOL_CHOICE_MODE_REQUIRED, tools=()), "prompt.chat.tool_choice"),
        (
            chat(common_pb2.TOOL_CHOICE_MODE_REQUIRED, tools=(ADD, ADD)),
            "prompt.chat.tools[1].name",
        ),
        (
            chat(
                common_pb2.TOOL_CHOICE_MODE_REQUIRED,
                tools=(common_pb2.ToolDefinition(name="bad name"),),
            ),
            "prompt.chat.tools[0].name",
        ),
        (
            chat(
                common_pb2.TOOL_CHOICE_MODE_REQUIRED,
                tools=(common_pb2.ToolDefinition(name="x", parameters_json_schema="[1]"),),
            ),
            "prompt.chat.tools[0].parameters_json_schema",
        ),
    ],
)
def test_bad_tools_name_the_field(request_chat: common_pb2.ChatMessages, field: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        plan_tools(request_chat)
    assert refused.value.field == field


def test_kvmesh_format_lists_tools_and_renders_calls_as_their_json() -> None:
    conversation = chat(common_pb2.TOOL_CHOICE_MODE_NONE)
    conversation.messages.add(
        role="assistant",
        tool_calls=[common_pb2.ToolCall(id="call_1", name="add", arguments_json='{"a": 2}')],
    )
    conversation.messages.add(role="tool", content="3", tool_call_id="call_1")
    plan = plan_tools(conversation)
    turns = chat_turns(conversation, plan, native=False)
    assert turns[0]["role"] == "system" and turns[0]["content"].startswith(KVMESH_TOOLS_HEADER)
    assert json.loads(turns[2]["content"]) == {"name": "add", "arguments": {"a": 2}}
    assert turns[3] == {"role": "tool", "content": "3", "tool_call_id": "call_1"}
    native = chat_turns(conversation, plan, native=True)
    assert native[0]["role"] == "user"
    assert native[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2}'}


def test_template_detection_and_parsing() -> None:
    assert template_takes_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_takes_tools("{{ messages }}") and not template_takes_tools(None)
    call = parse_call('{"name": "add", "arguments": {"a": 5}}')
    assert call.id.startswith("call_") and call.name == "add"
    assert json.loads(call.arguments_json) == {"a": 5}
    with pytest.raises(ValueError):
        parse_call('{"name": "add", "argu')


@pytest.mark.parametrize(
    "mode", [common_pb2.TOOL_CHOICE_MODE_AUTO, common_pb2.TOOL_CHOICE_MODE_UNSPECIFIED]
)
def test_auto_constrains_only_a_tagged_call_and_ends_after_it(mode: int) -> None:
    plan = plan_tools(chat(mode))
    assert plan is not None and plan.answer_schema is None and plan.call_tag is not None
    tag = structural_tag(plan.call_tag)
    assert tag.triggers == ("<tool_call>",) and tag.stop_after_first
    (structure,) = tag.structures
    assert (structure.begin, structure.end) == (CALL_BEGIN, CALL_END)
    jsonschema.validate({"name": "add", "arguments": {"a": 1}}, structure.schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", "arguments": {"a": "1"}}, structure.schema)
    sampling = common_pb2.SamplingParams()
    assert constrain_answer(plan, sampling) and sampling.structural_tag == plan.call_tag
    with pytest.raises(InvalidArgument) as refused:
        constrain_answer(plan, common_pb2.SamplingParams(regex="a"))
    assert refused.value.field == "sampling"
    none = plan_tools(chat(common_pb2.TOOL_CHOICE_MODE_NONE))
    assert none is not None and not constrain_answer(none, common_pb2.SamplingParams())


def test_an_auto_answer_is_text_or_text_then_one_call() -> None:
    plan = plan_tools(chat(common_pb2.TOOL_CHOICE_MODE_AUTO))
    assert plan is not None
    call_json = '{"name": "add", "arguments": {"a": 2}}'
    answer = "Let me add.<tool_call>\n" + call_json + "\n</tool_call>"
    assert split_answer(answer) == ("Let me add.", call_json)
    (call,) = answer_calls(plan, answer)
    assert call.name == "add" and json.loads(call.arguments_json) == {"a": 2}
    assert answer_calls(plan, "just text") == []
    assert split_answer("cut <tool_call>\n{") == ("cut <tool_call>\n{", None)
    # What a stream may release as content: nothing from the trigger (or a start of it) on.
    assert free_text_end("Let me <tool") == len("Let me ")
    assert free_text_end("Let me <tool_call>\n{") == len("Let me ")
    assert free_text_end("a < b") == len("a < b") and free_text_end("") == 0


def test_auto_renders_calls_in_their_tag_and_natively_only_with_a_tagging_template() -> None:
    plan = plan_tools(chat(common_pb2.TOOL_CHOICE_MODE_AUTO))
    conversation = chat(common_pb2.TOOL_CHOICE_MODE_AUTO)
    conversation.messages.append(
        common_pb2.ChatMessage(
            role="assistant",
            tool_calls=[common_pb2.ToolCall(id="c1", name="add", arguments_json='{"a": 2}')],
        )
    )
    turns = chat_turns(conversation, plan, native=False)
    assert turns[0]["content"].startswith(KVMESH_TAGGED_TOOLS_HEADER)
    assert turns[2]["content"] == CALL_BEGIN + '{"name": "add", "arguments": {"a": 2}}' + CALL_END
    hermes = "{% if tools %}{{ tools | tojson }} <tool_call>{% endif %}"
    llama = "{% if tools %}{{ tools | tojson }}{% endif %}"
    required = plan_tools(chat(common_pb2.TOOL_CHOICE_MODE_REQUIRED))
    assert renders_natively(plan, hermes) and not renders_natively(plan, llama)
    assert renders_natively(required, llama) and not renders_natively(None, hermes)
