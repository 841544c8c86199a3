"""The llguidance grammar backend (the second; Lark native, EBNF converted)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import llguidance
import llguidance.hf
import torch
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
            return matcher.grammar_from_lark(triggered_lark(constraint.text, self._tokenizer))
        return matcher.grammar_from_lark(constraint.text)

    def matcher(self, compiled: object) -> GrammarMatcher:
        return _Matcher(llguidance.LLMatcher(self._tokenizer, cast(str, compiled), log_level=0))

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        # The executor writes raw memory: one int32 row of `words` per matcher, back to back.
        # (llguidance.torch wraps this call too, but importing it runs torch.compile, which
        # imports torch._dynamo and inductor: seconds for nothing the engine uses.)
        if bitmask.dtype != torch.int32 or not (bitmask.is_contiguous() and bitmask.is_cpu):
            raise ValueError("the token bitmask must be a contiguous int32 CPU tensor")
        rows = [(cast(_Matcher, m).inner, i) for i, m in enumerate(matchers)]
        batch, words = bitmask.shape
        row_bytes = words * bitmask.element_size()
        self._executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), row_bytes, batch)


def triggered_lark(text: str, tokenizer: llguidance.LLTokenizer) -> str:
    """A kvmesh structural tag as a lazy Lark grammar: free TEXT, and for each structure the
    TEXT up to its trigger (a lazy lexeme, so free text ends at the trigger's first
    occurrence; or, where the trigger is one of the tokenizer's added tokens, which llguidance
    keeps out of text, TEXT followed by that token), then the rest of its begin, its JSON
    value and its end."""
    tag = structural_tag(text)
    rules = ["%llguidance {}", "TEXT: /(.|\\n)*/"]
    for index, structure in enumerate(tag.structures):
        trigger = next(t for t in tag.triggers if structure.begin.startswith(t))
        schema = {**structure.schema, "x-guidance": JSON_OPTIONS}
        body = [
            _lark_text(structure.begin[len(trigger) :], tokenizer),
            "%json " + json.dumps(schema),
            _lark_text(structure.end, tokenizer),
        ]
        opening = _lark_text(trigger, tokenizer)
        if opening.startswith("<"):
            rules.append(f"opens_{index}: TEXT {opening}")
        else:
            rules.append(f"opens_{index}[lazy]: TEXT {opening}")
        rules.append(f"segment_{index}: opens_{index} " + " ".join(b for b in body if b))
    segments = " | ".join(f"segment_{i}" for i in range(len(tag.structures)))
    start = f"TEXT | {segments}" if tag.stop_after_first else f"({segments})* TEXT"
    return "\n".join([*rules, f"start: {start}"])


def _lark_text(text: str, tokenizer: llguidance.LLTokenizer) -> str:
    """Lark for exactly this text: string literals, and the tokenizer's added (special)
    tokens it contains by name (llguidance matches those only as themselves)."""
    parts: list[str] = []
    plain: list[int] = []
    for token in tokenizer.tokenize_str(text):
        if tokenizer.is_special_token(token):
            if plain:
                parts.append(json.dumps(tokenizer.decode_str(plain)))
                plain = []
            parts.append(tokenizer.decode_str([token]))
        else:
            plain.append(token)
    if plain:
        parts.append(json.dumps(tokenizer.decode_str(plain)))
    return " ".join(parts)


class _Matcher:
    __slots__ = ("inner",)

    def __init__(self, inner: llguidance.LLMatcher) -> None:
        self.inner = inner

    def accept(self, token_id: int) -> bool:
        return bool(self.inner.consume_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.inner.is_stopped())
