"""The constraint every hop checks: read from the proto, bounded, refused naming the field."""

from __future__ import annotations

import json

import pytest

from kvmesh.contracts.constraints import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_CONSTRAINT_CHARS,
    Constraint,
    ConstraintError,
    ConstraintKind,
    StructuralTag,
    Structure,
    checked_constraint,
    constraint_from_proto,
    structural_tag,
)
from kvmesh.errors import InvalidArgument
from kvmesh.v1 import common_pb2

TAG = StructuralTag(("<t>",), (Structure("<t>", {"type": "object"}, "</t>"),), True).as_json()


def tag(**changes: object) -> common_pb2.SamplingParams:
    value = {"triggers": ["<t>"], "structures": [{"begin": "<t>", "schema": {}, "end": ""}]}
    return common_pb2.SamplingParams(structural_tag=json.dumps({**value, **changes}))


def grammar(
    notation: common_pb2.GrammarNotation.ValueType, source: str
) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(grammar=common_pb2.Grammar(notation=notation, source=source))


@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        (common_pb2.SamplingParams(), None),
        (
            common_pb2.SamplingParams(json_schema='{"type": "integer"}'),
            Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "integer"}'),
        ),
        (common_pb2.SamplingParams(json_object=True), Constraint(ConstraintKind.JSON_OBJECT)),
        (common_pb2.SamplingParams(regex="[0-9]+"), Constraint(ConstraintKind.REGEX, "[0-9]+")),
        (
            grammar(common_pb2.GRAMMAR_NOTATION_EBNF, 'root ::= "a"'),
            Constraint(ConstraintKind.EBNF, 'root ::= "a"'),
        ),
        (
            grammar(common_pb2.GRAMMAR_NOTATION_LARK, 'start: "a"'),
            Constraint(ConstraintKind.LARK, 'start: "a"'),
        ),
        (
            common_pb2.SamplingParams(choice=common_pb2.Choice(options=["yes", "no"])),
            Constraint(ConstraintKind.CHOICE, options=("yes", "no")),
        ),
        (
            common_pb2.SamplingParams(structural_tag=TAG),
            Constraint(ConstraintKind.STRUCTURAL_TAG, TAG),
        ),
    ],
)
def test_each_kind_reads_into_one_constraint(
    sampling: common_pb2.SamplingParams, expected: Constraint | None
) -> None:
    assert constraint_from_proto(sampling) == expected


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (common_pb2.SamplingParams(json_schema="{not json"), "sampling.json_schema"),
        (common_pb2.SamplingParams(json_schema="[1, 2]"), "sampling.json_schema"),
        (common_pb2.SamplingParams(json_schema=""), "sampling.json_schema"),
        (common_pb2.SamplingParams(json_object=False), "sampling.json_object"),
        (common_pb2.SamplingParams(regex="a" * (MAX_CONSTRAINT_CHARS + 1)), "sampling.regex"),
        (grammar(common_pb2.GRAMMAR_NOTATION_UNSPECIFIED, "x"), "sampling.grammar.notation"),
        (grammar(common_pb2.GRAMMAR_NOTATION_LARK, ""), "sampling.grammar"),
        (common_pb2.SamplingParams(choice=common_pb2.Choice()), "sampling.choice.options"),
        (
            common_pb2.SamplingParams(choice=common_pb2.Choice(options=["a"] * (MAX_CHOICES + 1))),
            "sampling.choice.options",
        ),
        (
            common_pb2.SamplingParams(choice=common_pb2.Choice(options=["ok", ""])),
            "sampling.choice.options[1]",
        ),
        (
            common_pb2.SamplingParams(
                choice=common_pb2.Choice(options=["x" * (MAX_CHOICE_CHARS + 1)])
            ),
            "sampling.choice.options[0]",
        ),
        (common_pb2.SamplingParams(structural_tag="[]"), "sampling.structural_tag"),
        (tag(triggers=[]), "sampling.structural_tag.triggers"),
        (tag(triggers=[""]), "sampling.structural_tag.triggers"),
        (tag(structures=[]), "sampling.structural_tag.structures"),
        (
            tag(structures=[{"begin": "<u>", "schema": {}}]),
            "sampling.structural_tag.structures[0].begin",
        ),
        (
            tag(structures=[{"begin": "<t>", "schema": "{}"}]),
            "sampling.structural_tag.structures[0].schema",
        ),
        (
            tag(structures=[{"begin": "<t>", "schema": {}, "end": 1}]),
            "sampling.structural_tag.structures[0].end",
        ),
        (tag(stop_after_first="yes"), "sampling.structural_tag.stop_after_first"),
    ],
)
def test_refusals_name_the_field(sampling: common_pb2.SamplingParams, field: str) -> None:
    with pytest.raises(ConstraintError) as refused:
        constraint_from_proto(sampling)
    assert refused.value.field == field
    with pytest.raises(InvalidArgument) as invalid:
        checked_constraint(sampling)
    assert invalid.value.field == field


def test_constraint_is_hashable_and_equal_by_value() -> None:
    a = Constraint(ConstraintKind.CHOICE, options=("a", "b"))
    assert {a: 1}[Constraint(ConstraintKind.CHOICE, options=("a", "b"))] == 1
    assert a != Constraint(ConstraintKind.CHOICE, options=("b", "a"))


def test_a_structural_tag_round_trips_through_its_json_text() -> None:
    parsed = structural_tag(TAG)
    assert parsed == StructuralTag(("<t>",), (Structure("<t>", {"type": "object"}, "</t>"),), True)
    assert structural_tag(parsed.as_json()) == parsed
