"""Structured-output constraints: the value every hop passes on, and its bounds.

A request's `SamplingParams.constraint` (a JSON Schema, any JSON object, a regex, a grammar, a
choice of strings, or a structural tag: free text with triggered JSON segments) becomes one
frozen `Constraint` here. The gateway, the router and each worker check it with
`checked_constraint`, from this one definition of its bounds; the worker's engine compiles it
with its grammar backend and refuses what does not compile.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmesh.errors import InvalidArgument

if TYPE_CHECKING:
    from kvmesh.v1 import common_pb2

MAX_CONSTRAINT_CHARS = 64 * 1024
"""Longest JSON Schema, regex or grammar text (a schema of a few dozen tool parameters is
a few KiB; past this, compiling becomes a cost the gateway cannot see)."""
MAX_CHOICES = 256
"""Most options of a choice constraint."""
MAX_CHOICE_CHARS = 1024
"""Longest option of a choice constraint."""

# GrammarNotation enum values of common.proto (kept here so this module needs no protobuf).
_NOTATION_EBNF = 1
_NOTATION_LARK = 2


class ConstraintKind(enum.Enum):
    """What the constraint's text is."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    EBNF = "ebnf"
    LARK = "lark"
    CHOICE = "choice"
    STRUCTURAL_TAG = "structural_tag"


_FIELDS = {
    ConstraintKind.JSON_SCHEMA: "sampling.json_schema",
    ConstraintKind.JSON_OBJECT: "sampling.json_object",
    ConstraintKind.REGEX: "sampling.regex",
    ConstraintKind.EBNF: "sampling.grammar",
    ConstraintKind.LARK: "sampling.grammar",
    ConstraintKind.CHOICE: "sampling.choice",
    ConstraintKind.STRUCTURAL_TAG: "sampling.structural_tag",
}


class ConstraintError(ValueError):
    """A constraint refused (out of bounds, malformed, or not compilable); names its field."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail


@dataclass(slots=True, frozen=True)
class Constraint:
    """One request's output constraint; hashable, so compiled grammars are cached by it."""

    kind: ConstraintKind
    text: str = ""
    """The JSON Schema, regex or grammar source ("" for JSON_OBJECT and CHOICE)."""
    options: tuple[str, ...] = ()
    """The allowed answers of a CHOICE."""

    @property
    def field(self) -> str:
        """The request field it came from, named in every refusal."""
        return _FIELDS[self.kind]

    def validate(self) -> None:
        """ConstraintError unless within bounds and well formed (compiling is the engine's)."""
        if self.kind is ConstraintKind.CHOICE:
            self._validate_options()
        elif self.kind is not ConstraintKind.JSON_OBJECT:
            self._validate_text()

    def _validate_text(self) -> None:
        if not self.text:
            raise ConstraintError(self.field, "must not be empty")
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise ConstraintError(self.field, f"at most {MAX_CONSTRAINT_CHARS} characters")
        if self.kind is ConstraintKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.text)
            except ValueError as error:
                raise ConstraintError(self.field, f"not valid JSON: {error}") from None
            if not isinstance(schema, dict):
                raise ConstraintError(self.field, "must be a JSON object (a JSON Schema)")
        elif self.kind is ConstraintKind.STRUCTURAL_TAG:
            structural_tag(self.text)

    def _validate_options(self) -> None:
        if not 1 <= len(self.options) <= MAX_CHOICES:
            raise ConstraintError("sampling.choice.options", f"must hold 1-{MAX_CHOICES} options")
        for index, option in enumerate(self.options):
            if not 1 <= len(option) <= MAX_CHOICE_CHARS:
                raise ConstraintError(
                    f"sampling.choice.options[{index}]",
                    f"options must be 1-{MAX_CHOICE_CHARS} characters",
                )


@dataclass(slots=True, frozen=True)
class Structure:
    """One tagged segment of a structural tag: begin, a JSON value, end."""

    begin: str
    """Text that opens the segment; it starts with one of the tag's triggers."""
    schema: dict[str, Any]
    """The JSON Schema the value between begin and end validates against."""
    end: str
    """Text that closes the segment."""


@dataclass(slots=True, frozen=True)
class StructuralTag:
    """Free text in which every segment a trigger opens is constrained (tool_choice auto)."""

    triggers: tuple[str, ...]
    """Strings that, once written, start a structure beginning with them."""
    structures: tuple[Structure, ...]
    stop_after_first: bool
    """The answer ends after its first structure."""

    def triggered_tags(self, content: Callable[[Structure], dict[str, Any]]) -> dict[str, Any]:
        """The tag as xgrammar's structural tag of the triggered-tags format (stop_after_first
        included), each structure's value written by `content`: the native engine's xgrammar
        backend gives a strict JSON grammar, vLLM's a JSON Schema."""
        tags = [
            {"type": "tag", "begin": s.begin, "content": content(s), "end": s.end}
            for s in self.structures
        ]
        triggered = {
            "type": "triggered_tags",
            "triggers": list(self.triggers),
            "tags": tags,
            "stop_after_first": self.stop_after_first,
        }
        return {"type": "structural_tag", "format": triggered}

    def as_json(self) -> str:
        """The JSON text SamplingParams.structural_tag carries."""
        structures = [{"begin": s.begin, "schema": s.schema, "end": s.end} for s in self.structures]
        return json.dumps(
            {
                "triggers": list(self.triggers),
                "structures": structures,
                "stop_after_first": self.stop_after_first,
            }
        )


def structural_tag(text: str) -> StructuralTag:
    """The structural tag JSON text describes; ConstraintError names what is wrong."""
    field = _FIELDS[ConstraintKind.STRUCTURAL_TAG]
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ConstraintError(field, f"not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ConstraintError(field, "must be a JSON object")
    triggers = value.get("triggers")
    if (
        not isinstance(triggers, list)
        or not triggers
        or not all(isinstance(t, str) and t for t in triggers)
    ):
        raise ConstraintError(f"{field}.triggers", "must be a list of non-empty strings")
    raw_structures = value.get("structures")
    if not isinstance(raw_structures, list) or not raw_structures:
        raise ConstraintError(f"{field}.structures", "must be a non-empty list")
    structures = tuple(
        _structure(f"{field}.structures[{i}]", s, triggers) for i, s in enumerate(raw_structures)
    )
    stop_after_first = value.get("stop_after_first", False)
    if not isinstance(stop_after_first, bool):
        raise ConstraintError(f"{field}.stop_after_first", "must be true or false")
    return StructuralTag(tuple(triggers), structures, stop_after_first)


def _structure(field: str, value: object, triggers: list[str]) -> Structure:
    if not isinstance(value, dict):
        raise ConstraintError(field, "must be an object with begin, schema and end")
    begin, schema, end = value.get("begin"), value.get("schema"), value.get("end", "")
    if not isinstance(begin, str) or not any(begin.startswith(t) for t in triggers):
        raise ConstraintError(f"{field}.begin", "must be a string starting with a trigger")
    if not isinstance(schema, dict):
        raise ConstraintError(f"{field}.schema", "must be a JSON Schema (an object)")
    if not isinstance(end, str):
        raise ConstraintError(f"{field}.end", "must be a string")
    return Structure(begin, schema, end)


def constraint_from_proto(sampling: common_pb2.SamplingParams) -> Constraint | None:
    """The constraint a SamplingParams carries (None: free text), validated."""
    kind = sampling.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_schema":
        constraint = Constraint(ConstraintKind.JSON_SCHEMA, sampling.json_schema)
    elif kind == "json_object":
        if not sampling.json_object:
            raise ConstraintError("sampling.json_object", "must be true when set")
        constraint = Constraint(ConstraintKind.JSON_OBJECT)
    elif kind == "regex":
        constraint = Constraint(ConstraintKind.REGEX, sampling.regex)
    elif kind == "grammar":
        constraint = Constraint(_grammar_kind(sampling.grammar.notation), sampling.grammar.source)
    elif kind == "structural_tag":
        constraint = Constraint(ConstraintKind.STRUCTURAL_TAG, sampling.structural_tag)
    else:
        constraint = Constraint(ConstraintKind.CHOICE, options=tuple(sampling.choice.options))
    constraint.validate()
    return constraint


def _grammar_kind(notation: int) -> ConstraintKind:
    if notation == _NOTATION_EBNF:
        return ConstraintKind.EBNF
    if notation == _NOTATION_LARK:
        return ConstraintKind.LARK
    raise ConstraintError("sampling.grammar.notation", "must be EBNF or LARK")


def checked_constraint(sampling: common_pb2.SamplingParams) -> Constraint | None:
    """constraint_from_proto for a service: a refusal is InvalidArgument naming the field."""
    try:
        return constraint_from_proto(sampling)
    except ConstraintError as error:
        raise InvalidArgument(error.field, error.detail) from None
