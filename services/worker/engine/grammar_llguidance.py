"""The llguidance grammar backend (the second; Lark native, EBNF converted)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import llguidance
import llguidance.hf
import llguidance.torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from kvmesh.contracts.constraints import Constraint, ConstraintKind, structural_tag
from services.worker.engine.grammar import (
    JSON_OBJECT_SCHEMA,
    GrammarMatcher,
    choice_regex,
    hf_tokenizer,
    refusal,
)

if TYPE_CHECKING:
    import torch

    from kvmesh.contracts.tokenizer import Tokenizer

# The same compact JSON as the xgrammar backend writes (", " and ": ", no free whitespace).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LlguidanceBackend:
    """A compiled grammar is llguidance's validated grammar text; a matcher parses it anew
    (llguidance builds its lexer lazily, so that is cheap)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer(tokenizer),
            n_vocab=vocab_size,
            eos_token=sorted(tokenizer.eos_token_ids) or None,
        )
        self._executor = llguidance.LLExecutor(1)

    def compile(self, constraint: Constraint) -> object:
        try:
            grammar = self._grammar(constraint)
        except Exception as error:  # noqa: BLE001 - gbnf_to_lark raises bare Exception
            raise refusal(constraint, error) from None
        problem = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if problem:
            raise refusal(constraint, ValueError(problem))
        return grammar

    def _grammar(self, constraint: Constraint) -> str:
        kind = constraint.kind
        matcher = llguidance.LLMatcher
        if kind is ConstraintKind.JSON_SCHEMA or kind is ConstraintKind.JSON_OBJECT:
            schema = constraint.text if kind is ConstraintKind.JSON_SCHEMA else JSON_OBJECT_SCHEMA
            return matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if kind is ConstraintKind.REGEX:
            return matcher.grammar_from_regex(constraint.text)
        if kind is ConstraintKind.CHOICE:
            return matcher.grammar_from_regex(choice_regex(constraint.options))
        if kind is ConstraintKind.EBNF:
            return matcher.grammar_from_lark(gbnf_to_lark(constraint.text))
        if kind is ConstraintKind.STRUCTURAL_TAG:
            return matcher.grammar_from_lark(triggered_lark(constraint.text))
        return matcher.grammar_from_lark(constraint.text)

    def matcher(self, compiled: object) -> GrammarMatcher:
        return _Matcher(llguidance.LLMatcher(self._tokenizer, cast(str, compiled), log_level=0))

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        rows = [(cast(_Matcher, m).inner, i) for i, m in enumerate(matchers)]
        llguidance.torch.fill_next_token_bitmask_par(self._executor, rows, bitmask)


def triggered_lark(text: str) -> str:
    """A kvmesh structural tag as a lazy Lark grammar: free TEXT, and for each structure a
    lazy lexeme (TEXT up to the first occurrence of its trigger, so free text ends exactly
    there) followed by the rest of its begin, its JSON value and its end."""
    tag = structural_tag(text)
    rules = ["%llguidance {}", "TEXT: /(.|\\n)*/"]
    for index, structure in enumerate(tag.structures):
        trigger = next(t for t in tag.triggers if structure.begin.startswith(t))
        schema = {**structure.schema, "x-guidance": JSON_OPTIONS}
        rest = [json.dumps(structure.begin[len(trigger) :]), "%json " + json.dumps(schema)]
        rest += [json.dumps(structure.end)] if structure.end else []
        rules.append(f"opens_{index}[lazy]: TEXT {json.dumps(trigger)}")
        rules.append(f"segment_{index}: opens_{index} " + " ".join(r for r in rest if r != '""'))
    segments = " | ".join(f"segment_{i}" for i in range(len(tag.structures)))
    start = f"TEXT | {segments}" if tag.stop_after_first else f"({segments})* TEXT"
    return "\n".join([*rules, f"start: {start}"])


class _Matcher:
    __slots__ = ("inner",)

    def __init__(self, inner: llguidance.LLMatcher) -> None:
        self.inner = inner

    def accept(self, token_id: int) -> bool:
        return bool(self.inner.consume_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.inner.is_stopped())
