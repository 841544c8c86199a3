"""The xgrammar grammar backend (the default; vLLM's and SGLang's default too)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
import xgrammar

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

# xgrammar writes a string with minLength/maxLength as a run of this character class, which
# admits the raw control characters U+0000-U+001F that JSON forbids inside strings (its other
# string rules exclude them); the JSON grammars are compiled with the class that excludes them.
LOOSE_STRING_CHARACTER = r"[^\"\\\r\n]"
STRICT_STRING_CHARACTER = r"[^\"\\\0-\x1f]"


class XgrammarBackend:
    """Compiles with xgrammar.GrammarCompiler; fills masks with one BatchGrammarMatcher call."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        stop_ids = sorted(tokenizer.eos_token_ids) or None
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer(tokenizer), vocab_size=vocab_size, stop_token_ids=stop_ids
        )
        # Its own cache is off: GrammarCompiler caches (and bounds) compiled grammars.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=1)

    def compile(self, constraint: Constraint) -> object:
        try:
            return self._compile(constraint)
        except (RuntimeError, ValueError) as error:  # xgrammar reports parse errors so
            raise refusal(constraint, error) from None

    def _compile(self, constraint: Constraint) -> xgrammar.CompiledGrammar:
        kind = constraint.kind
        if kind is ConstraintKind.JSON_SCHEMA or kind is ConstraintKind.JSON_OBJECT:
            schema = constraint.text if kind is ConstraintKind.JSON_SCHEMA else JSON_OBJECT_SCHEMA
            return self._compiler.compile_grammar(strict_json_ebnf(schema))
        if kind is ConstraintKind.STRUCTURAL_TAG:
            return self._compiler.compile_structural_tag(triggered_tags(constraint.text))
        if kind is ConstraintKind.REGEX:
            return self._compiler.compile_regex(constraint.text)
        if kind is ConstraintKind.CHOICE:
            return self._compiler.compile_regex(choice_regex(constraint.options))
        if kind is ConstraintKind.LARK:
            return self._compiler.compile_lark(constraint.text)
        return self._compiler.compile_grammar(constraint.text)

    def matcher(self, compiled: object) -> GrammarMatcher:
        return _Matcher(xgrammar.GrammarMatcher(cast(xgrammar.CompiledGrammar, compiled)))

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        inner = [cast(_Matcher, m).inner for m in matchers]
        self._batch.batch_fill_next_token_bitmask(inner, bitmask)


def strict_json_ebnf(schema: str) -> str:
    """The schema's grammar as EBNF whose strings hold no raw control character. Compact JSON
    (", " and ": "): no run of whitespace for a sampler to wander into."""
    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    return str(grammar).replace(LOOSE_STRING_CHARACTER, STRICT_STRING_CHARACTER)


def triggered_tags(text: str) -> dict[str, object]:
    """A kvmesh structural tag as xgrammar's triggered-tags format (each structure's value a
    strict JSON grammar, as above)."""
    return structural_tag(text).triggered_tags(
        lambda s: {"type": "grammar", "grammar": strict_json_ebnf(json.dumps(s.schema))}
    )


class _Matcher:
    __slots__ = ("inner",)

    def __init__(self, inner: xgrammar.GrammarMatcher) -> None:
        self.inner = inner

    def accept(self, token_id: int) -> bool:
        return bool(self.inner.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.inner.is_terminated())
