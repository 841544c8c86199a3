"""kvmesh's structured-output constraint as vLLM's structured-output parameters.

Each kind maps onto one field of vLLM's StructuredOutputsParams (json, json_object, regex,
choice, grammar, structural_tag); vLLM compiles it with the backend the engine was started
with, which is the worker's `grammar_backend` ("xgrammar" -> vLLM's "xgrammar", "llguidance" ->
its "guidance"), with JSON written compactly as on the native engine.

vLLM's grammar field carries no notation: vLLM reads a grammar that defines a rule with "::="
as EBNF and any other as Lark. kvmesh states the notation, so a grammar vLLM would read in the
other notation is refused (INVALID_ARGUMENT on sampling.grammar.notation) rather than compiled
as something the client did not write. Whatever vLLM itself refuses is INVALID_ARGUMENT on the
constraint's field, before any token.
"""

from __future__ import annotations

import json

from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.utils import grammar_is_likely_lark

from kvmesh.contracts.constraints import (
    Constraint,
    ConstraintError,
    ConstraintKind,
    structural_tag,
)

VLLM_GRAMMAR_BACKENDS = {"xgrammar": "xgrammar", "llguidance": "guidance"}
"""EngineConfig.grammar_backend -> vLLM's StructuredOutputsConfig.backend."""

NOTATION_FIELD = "sampling.grammar.notation"


def structured_outputs(constraint: Constraint, grammar_backend: str) -> StructuredOutputsParams:
    """vLLM's parameters for one constraint under the worker's grammar backend (ConstraintError
    naming the field where vLLM cannot take it)."""
    kind = constraint.kind
    if kind is ConstraintKind.STRUCTURAL_TAG:
        return StructuredOutputsParams(structural_tag=_structural_tag(constraint, grammar_backend))
    if kind is ConstraintKind.JSON_SCHEMA:
        return StructuredOutputsParams(json=constraint.text)
    if kind is ConstraintKind.JSON_OBJECT:
        return StructuredOutputsParams(json_object=True)
    if kind is ConstraintKind.REGEX:
        return StructuredOutputsParams(regex=constraint.text)
    if kind is ConstraintKind.CHOICE:
        return StructuredOutputsParams(choice=list(constraint.options))
    read_as_ebnf = not grammar_is_likely_lark(constraint.text)  # vLLM's own reading
    if read_as_ebnf != (kind is ConstraintKind.EBNF):
        written = "EBNF" if kind is ConstraintKind.EBNF else "Lark"
        read = "EBNF" if read_as_ebnf else "Lark"
        raise ConstraintError(
            NOTATION_FIELD,
            f"vLLM would read this {written} grammar as {read} (it takes a grammar with a "
            "'::=' rule for EBNF, any other for Lark)",
        )
    return StructuredOutputsParams(grammar=constraint.text)


def _structural_tag(constraint: Constraint, grammar_backend: str) -> str:
    """A kvmesh structural tag in the JSON vLLM's backend reads: xgrammar takes its own
    triggered-tags format (stop_after_first included); vLLM's guidance backend takes only the
    older triggers + structures form, which cannot stop after the first structure."""
    tag = structural_tag(constraint.text)
    if grammar_backend == "xgrammar":
        return json.dumps(
            tag.triggered_tags(lambda s: {"type": "json_schema", "json_schema": s.schema})
        )
    if tag.stop_after_first:
        raise ConstraintError(
            f"{constraint.field}.stop_after_first",
            "vLLM's guidance backend cannot stop after the first structure (run the worker "
            "with --grammar-backend xgrammar)",
        )
    structures = [{"begin": s.begin, "schema": s.schema, "end": s.end} for s in tag.structures]
    return json.dumps({"triggers": list(tag.triggers), "structures": structures})
