"""Streaming a response-cache hit: chunked tokens whose texts add up to the stored text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.v1 import cache_pb2, common_pb2
from services.admission.transcript import CACHE_HIT_CHUNK_TOKENS, cache_hit_chunks


class WordTokenizer:
    """Token i decodes to "w{i} "."""

    vocab_size = 1000
    max_token_chars = 5
    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f"w{i} " for i in ids)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        return []


def stored(ids: list[int], text: str) -> cache_pb2.CachedResponse:
    return cache_pb2.CachedResponse(
        token_ids=ids, text=text, finish_reason=common_pb2.FINISH_REASON_STOP
    )


def test_chunks_cover_all_tokens_and_exactly_the_stored_text() -> None:
    ids = list(range(40))
    text = WordTokenizer().decode(ids)
    chunks = list(cache_hit_chunks(stored(ids, text), WordTokenizer()))
    assert len(chunks) == 3
    assert [len(c.token_ids) for c in chunks] == [CACHE_HIT_CHUNK_TOKENS] * 2 + [8]
    assert [t for c in chunks for t in c.token_ids] == ids
    assert "".join(c.text for c in chunks) == text
    assert chunks[0].text == WordTokenizer().decode(ids[:16])


def test_a_stored_text_shorter_than_the_decode_still_adds_up() -> None:
    # e.g. a stop string was cut off the stored text.
    ids = list(range(20))
    chunks = list(cache_hit_chunks(stored(ids, "w0 w1"), WordTokenizer()))
    assert "".join(c.text for c in chunks) == "w0 w1"


def test_an_empty_answer_has_no_chunks() -> None:
    assert list(cache_hit_chunks(stored([], ""), WordTokenizer())) == []
