"""Tool calling in chat: tools into the prompt, a grammar over the answer, calls out of it.

A chat request with tools is rendered by the model's chat template when the template takes
`tools` (the template shows them its own way); otherwise kvmesh shows them in one documented
format (docs/tool_calls.md): a system turn listing each tool as JSON and asking for a call as
one JSON object {"name": ..., "arguments": {...}}; earlier calls are rendered as that object.

With tool_choice REQUIRED (or a NAMED tool) the whole answer is constrained by a JSON Schema
(one call of one of the tools, its arguments validating against that tool's schema), so the
call always parses; the gateway turns the answer into a ToolCall with a fresh id and the
finish reason TOOL_CALLS. NONE leaves the answer free text. AUTO (the default with tools: the
model chooses between text and a call) constrains the answer with a structural tag: the text
is free until the model writes `<tool_call>`, and from there it must write a newline, one call
as above, a newline and `</tool_call>`, which ends the answer. So an AUTO answer is text, or
text followed by one tagged call; the tools are rendered natively only by a template that
writes calls in that tag (Hermes/Qwen style), otherwise in kvmesh's format, which asks for it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvmesh.contracts.constraints import StructuralTag, Structure
from kvmesh.errors import InvalidArgument
from kvmesh.tool_format import CALL_BEGIN, CALL_END, CALL_TRIGGER, split_answer
from kvmesh.v1 import common_pb2

MAX_TOOLS = 64
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
KVMESH_TOOLS_HEADER = (
    "You can call these tools. To call one, answer with only a JSON object "
    '{"name": <tool name>, "arguments": <arguments object>}.\nTools:\n'
)
KVMESH_TAGGED_TOOLS_HEADER = (
    "You can call these tools. To call one, write\n<tool_call>\n"
    '{"name": <tool name>, "arguments": <arguments object>}\n</tool_call>\nTools:\n'
)
_ANY_OBJECT = {"type": "object"}


@dataclass(slots=True, frozen=True)
class ToolPlan:
    """What the tools of one request mean for its rendering and its answer."""

    tools: list[dict[str, Any]]
    """The tools as the OpenAI-style dicts chat templates read."""
    answer_schema: str | None
    """The JSON Schema constraining the whole answer to a call (REQUIRED, NAMED)."""
    call_tag: str | None = None
    """The structural tag (JSON text) constraining a tagged call within free text (AUTO)."""

    @property
    def tagged(self) -> bool:
        """Calls are written inside <tool_call> tags (AUTO)."""
        return self.call_tag is not None


def plan_tools(chat: common_pb2.ChatMessages) -> ToolPlan | None:
    """The request's tools checked and planned (None: no tools); InvalidArgument names the
    field of anything wrong."""
    mode = chat.tool_choice.mode
    if not chat.tools:
        if mode not in (common_pb2.TOOL_CHOICE_MODE_UNSPECIFIED, common_pb2.TOOL_CHOICE_MODE_NONE):
            raise InvalidArgument("prompt.chat.tool_choice", "a tool choice needs tools")
        return None
    tools = _checked_tools(chat.tools)
    if mode in (common_pb2.TOOL_CHOICE_MODE_UNSPECIFIED, common_pb2.TOOL_CHOICE_MODE_AUTO):
        return ToolPlan(tools, None, _call_tag(tools))
    if mode == common_pb2.TOOL_CHOICE_MODE_NONE:
        return ToolPlan(tools, None)
    if mode == common_pb2.TOOL_CHOICE_MODE_NAMED:
        chosen = [t for t in tools if t["function"]["name"] == chat.tool_choice.name]
        if not chosen:
            raise InvalidArgument(
                "prompt.chat.tool_choice.name", f"no tool named {chat.tool_choice.name!r}"
            )
        return ToolPlan(tools, json.dumps(_call_schema(chosen[0])))
    if mode != common_pb2.TOOL_CHOICE_MODE_REQUIRED:
        raise InvalidArgument("prompt.chat.tool_choice.mode", f"unknown mode {mode}")
    return ToolPlan(tools, json.dumps({"anyOf": [_call_schema(t) for t in tools]}))


def constrain_answer(plan: ToolPlan, sampling: common_pb2.SamplingParams) -> bool:
    """Puts the plan's constraint into the request's sampling; False when it has none (NONE:
    free text). A request that brings a constraint of its own as well is refused."""
    if plan.answer_schema is None and plan.call_tag is None:
        return False
    if sampling.WhichOneof("constraint") is not None:
        raise InvalidArgument(
            "sampling", "the tool choice constrains the answer: set no constraint as well"
        )
    if plan.answer_schema is not None:
        sampling.json_schema = plan.answer_schema
    else:
        sampling.structural_tag = plan.call_tag or ""
    return True


def _checked_tools(definitions: Any) -> list[dict[str, Any]]:
    if len(definitions) > MAX_TOOLS:
        raise InvalidArgument("prompt.chat.tools", f"at most {MAX_TOOLS} tools")
    tools: list[dict[str, Any]] = []
    names: set[str] = set()
    for index, tool in enumerate(definitions):
        field = f"prompt.chat.tools[{index}]"
        if not TOOL_NAME.fullmatch(tool.name):
            raise InvalidArgument(f"{field}.name", "must be 1-64 of [A-Za-z0-9_-]")
        if tool.name in names:
            raise InvalidArgument(f"{field}.name", f"{tool.name!r} is defined twice")
        names.add(tool.name)
        parameters = _ANY_OBJECT
        if tool.parameters_json_schema:
            try:
                parameters = json.loads(tool.parameters_json_schema)
            except ValueError as error:
                raise InvalidArgument(
                    f"{field}.parameters_json_schema", f"not valid JSON: {error}"
                ) from None
            if not isinstance(parameters, dict):
                raise InvalidArgument(f"{field}.parameters_json_schema", "must be a JSON object")
        function = {"name": tool.name, "description": tool.description, "parameters": parameters}
        tools.append({"type": "function", "function": function})
    return tools


def _call_tag(tools: list[dict[str, Any]]) -> str:
    structure = Structure(CALL_BEGIN, {"anyOf": [_call_schema(t) for t in tools]}, CALL_END)
    return StructuralTag((CALL_TRIGGER,), (structure,), stop_after_first=True).as_json()


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": function["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def template_takes_tools(chat_template: str | None) -> bool:
    """Whether the model's chat template renders a `tools` variable itself."""
    return chat_template is not None and re.search(r"\btools\b", chat_template) is not None


def renders_natively(plan: ToolPlan | None, chat_template: str | None) -> bool:
    """Whether the template shows the tools itself: it takes them and, for tagged calls,
    writes calls in the same tag (else kvmesh's format asks for the tag)."""
    if plan is None or not template_takes_tools(chat_template):
        return False
    return not plan.tagged or CALL_TRIGGER in (chat_template or "")


def chat_turns(
    chat: common_pb2.ChatMessages, plan: ToolPlan | None, native: bool
) -> list[dict[str, Any]]:
    """The conversation as chat-template messages; in kvmesh's format (native False) the
    tools become a leading system turn and calls the JSON text a call is answered with."""
    turns: list[dict[str, Any]] = []
    if plan is not None and not native:
        listing = "\n".join(json.dumps(tool["function"]) for tool in plan.tools)
        header = KVMESH_TAGGED_TOOLS_HEADER if plan.tagged else KVMESH_TOOLS_HEADER
        turns.append({"role": "system", "content": header + listing})
    for message in chat.messages:
        turn: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            calls = [_call_turn(call) for call in message.tool_calls]
            if native:
                turn["tool_calls"] = calls
            else:
                tagged = plan is not None and plan.tagged
                turn["content"] = "\n".join(_call_text(c, tagged) for c in calls)
        if message.tool_call_id:
            turn["tool_call_id"] = message.tool_call_id
        turns.append(turn)
    return turns


def _call_text(call: dict[str, Any], tagged: bool) -> str:
    text = json.dumps({"name": call["function"]["name"], "arguments": call["arguments"]})
    return CALL_BEGIN + text + CALL_END if tagged else text


def _call_turn(call: common_pb2.ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments_json or "{}")
    except ValueError as error:
        raise InvalidArgument("prompt.chat.messages.tool_calls", f"arguments: {error}") from None
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json},
        "arguments": arguments,
    }


def answer_calls(plan: ToolPlan, text: str) -> list[common_pb2.ToolCall]:
    """The calls of a complete answer produced under the plan's constraint (none: text)."""
    if not plan.tagged:
        return [parse_call(text)]
    call = split_answer(text)[1]
    return [] if call is None else [parse_call(call)]


def parse_call(text: str) -> common_pb2.ToolCall:
    """The ToolCall an answer produced under the call schema is (ValueError if it is not:
    an answer cut short, e.g. by max_tokens)."""
    call = json.loads(text)
    return common_pb2.ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        name=str(call["name"]),
        arguments_json=json.dumps(call["arguments"]),
    )
