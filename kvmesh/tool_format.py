"""How a tool call is written inside free text (tool_choice auto): `<tool_call>`, a newline,
the call's JSON `{"name": ..., "arguments": {...}}`, a newline, `</tool_call>`.

One definition for the gateway, which constrains answers to it and parses the call out, and the
HTTP door, which streams the free text before it as content and the call as tool_calls.
"""

from __future__ import annotations

CALL_TRIGGER = "<tool_call>"
"""Writing this starts a call (the structural tag's trigger)."""
CALL_BEGIN = CALL_TRIGGER + "\n"
CALL_END = "\n</tool_call>"


def split_answer(text: str) -> tuple[str, str | None]:
    """An answer's free text and its tagged call's JSON (None: no complete call)."""
    free, trigger, rest = text.partition(CALL_BEGIN)
    if not trigger or not rest.endswith(CALL_END):
        return text, None
    return free, rest[: -len(CALL_END)]


def free_text_end(text: str) -> int:
    """How much of a streamed answer so far is surely free text: everything before the
    trigger, or before a tail that may be the trigger's beginning."""
    found = text.find(CALL_TRIGGER)
    if found >= 0:
        return found
    for keep in range(min(len(CALL_TRIGGER) - 1, len(text)), 0, -1):
        if CALL_TRIGGER.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)
