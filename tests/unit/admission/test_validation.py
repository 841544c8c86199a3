"""Request validation: every error is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.tenants import PriorityClass
from kvmesh.v1 import common_pb2, gateway_pb2
from services.admission.catalog import ModelSpec
from services.admission.validation import (
    RequestLimits,
    check_envelope,
    checked_sampling,
    prompt_token_ids,
)


class CharTokenizer:
    """One token per character (code point mod vocab); chat = role + content."""

    vocab_size = 1000
    max_token_chars = 1
    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        if any(m["content"] == "refuse" for m in messages):
            raise ValueError("the template refused this conversation")
        text = "".join(f"{m['role']}:{m['content']};" for m in messages)
        return self.encode(text + ("assistant:" if add_generation_prompt else ""))


MODEL = ModelSpec(id="tiny", fingerprint="f", context_length=64)
LIMITS = RequestLimits(default_max_tokens=16, max_tokens_limit=32, max_stop_strings=2)


def field_of(call: object, *args: object, **kwargs: object) -> str | None:
    with pytest.raises(InvalidArgument) as raised:
        call(*args, **kwargs)  # type: ignore[operator]
    return raised.value.field


def text(value: str) -> common_pb2.Prompt:
    return common_pb2.Prompt(text=value)


def sampling_field(prompt_tokens: int = 10, **fields: object) -> str | None:
    return field_of(
        checked_sampling,
        common_pb2.SamplingParams(**fields),  # type: ignore[arg-type]
        prompt_tokens=prompt_tokens,
        model=MODEL,
        vocab_size=1000,
        limits=LIMITS,
    )


def test_prompts_become_token_ids() -> None:
    tok = CharTokenizer()
    assert prompt_token_ids(text("abc"), tok, MODEL) == [97, 98, 99]
    ids = prompt_token_ids(common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=[5, 6])), tok, MODEL)
    assert ids == [5, 6]
    chat = common_pb2.ChatMessages(
        messages=[common_pb2.ChatMessage(role="user", content="hi")], add_generation_prompt=True
    )
    assert tok.decode(prompt_token_ids(common_pb2.Prompt(chat=chat), tok, MODEL)) == (
        "user:hi;assistant:"
    )


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        (common_pb2.Prompt(), "prompt"),
        (text(""), "prompt.text"),
        (text("x" * 64), "prompt"),
        (common_pb2.Prompt(token_ids=common_pb2.TokenIds()), "prompt.token_ids"),
        (
            common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=[1, 1000])),
            "prompt.token_ids.ids[1]",
        ),
        (common_pb2.Prompt(chat=common_pb2.ChatMessages()), "prompt.chat.messages"),
        (
            common_pb2.Prompt(
                chat=common_pb2.ChatMessages(
                    messages=[common_pb2.ChatMessage(role="god", content="x")]
                )
            ),
            "prompt.chat.messages[0].role",
        ),
        (
            common_pb2.Prompt(
                chat=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user")])
            ),
            "prompt.chat.messages",
        ),
        (
            common_pb2.Prompt(
                chat=common_pb2.ChatMessages(
                    messages=[common_pb2.ChatMessage(role="user", content="refuse")]
                )
            ),
            "prompt.chat",
        ),
    ],
)
def test_bad_prompts_name_the_field(prompt: common_pb2.Prompt, field: str) -> None:
    assert field_of(prompt_token_ids, prompt, CharTokenizer(), MODEL) == field


def test_max_tokens_defaults_to_what_fits() -> None:
    def max_tokens(prompt_tokens: int) -> int:
        return checked_sampling(
            common_pb2.SamplingParams(),
            prompt_tokens=prompt_tokens,
            model=MODEL,
            vocab_size=1000,
            limits=LIMITS,
        ).max_tokens

    assert max_tokens(10) == 16
    assert max_tokens(60) == 4


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"max_tokens": 0}, "sampling.max_tokens"),
        ({"max_tokens": 33}, "sampling.max_tokens"),
        ({"max_tokens": 30, "prompt_tokens": 40}, "sampling.max_tokens"),
        ({"temperature": -0.1}, "sampling.temperature"),
        ({"temperature": math.nan}, "sampling.temperature"),
        ({"temperature": math.inf}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_k": 1001}, "sampling.top_k"),
        ({"logprobs": 21}, "sampling.logprobs"),
        ({"stop": ["a", "b", "c"]}, "sampling.stop"),
        ({"stop": ["a", ""]}, "sampling.stop[1]"),
        ({"stop_token_ids": [3, 1000]}, "sampling.stop_token_ids[1]"),
        ({"json_schema": "{"}, "sampling.json_schema"),
        ({"choice": common_pb2.Choice(options=["a", ""])}, "sampling.choice.options[1]"),
    ],
)
def test_bad_sampling_names_the_field(fields: dict[str, object], field: str) -> None:
    prompt_tokens = int(fields.pop("prompt_tokens", 10))  # type: ignore[call-overload]
    assert sampling_field(prompt_tokens, **fields) == field


def test_good_sampling_is_kept() -> None:
    checked = checked_sampling(
        common_pb2.SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=3, stop=["\n"]),
        prompt_tokens=10,
        model=MODEL,
        vocab_size=1000,
        limits=LIMITS,
    )
    assert checked.max_tokens == 8 and checked.seed == 3 and list(checked.stop) == ["\n"]


def test_envelope() -> None:
    envelope = check_envelope(gateway_pb2.GenerateRequest(priority=common_pb2.PRIORITY_BATCH))
    assert envelope.priority is PriorityClass.BATCH
    assert envelope.cache_policy == common_pb2.CACHE_POLICY_USE
    assert check_envelope(gateway_pb2.GenerateRequest()).priority is None
    bad = [
        (gateway_pb2.GenerateRequest(priority=7), "priority"),  # type: ignore[arg-type]
        (gateway_pb2.GenerateRequest(cache_policy=9), "cache_policy"),  # type: ignore[arg-type]
        (gateway_pb2.GenerateRequest(request_id="x" * 200), "request_id"),
        (gateway_pb2.GenerateRequest(request_id="a\nb"), "request_id"),
        (gateway_pb2.GenerateRequest(model="m" * 200), "model"),
        (gateway_pb2.GenerateRequest(labels={"": "x"}), "labels"),
        (gateway_pb2.GenerateRequest(labels={f"k{i}": "v" for i in range(40)}), "labels"),
        (gateway_pb2.GenerateRequest(labels={"k": "v" * 300}), "labels[k]"),
    ]
    for request, field in bad:
        assert field_of(check_envelope, request) == field


class RefusingTokenizer(CharTokenizer):
    """Fails the test if asked to tokenize: the size check must come first."""

    max_token_chars = 4

    def encode(self, text: str) -> list[int]:
        raise AssertionError("tokenized a prompt that cannot fit the context")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        raise AssertionError("rendered a chat that cannot fit the context")


@pytest.mark.parametrize(
    "prompt",
    [
        text("x" * (64 * 4 + 1)),
        text("x" * 7_900_000),
        common_pb2.Prompt(
            chat=common_pb2.ChatMessages(
                messages=[common_pb2.ChatMessage(role="user", content="x" * 200)] * 2
            )
        ),
    ],
    ids=["just-over", "7.9MB", "chat"],
)
def test_a_prompt_longer_than_the_context_could_hold_is_refused_untokenized(
    prompt: common_pb2.Prompt,
) -> None:
    # 64 tokens of at most 4 characters: 256 characters at most.
    with pytest.raises(InvalidArgument, match="256 characters") as raised:
        prompt_token_ids(prompt, RefusingTokenizer(), MODEL)
    assert raised.value.field == "prompt"


def test_a_prompt_within_the_bound_is_tokenized() -> None:
    # At the bound (64 tokens of 1 character) the text may still fit: it is tokenized, then
    # judged by its tokens.
    with pytest.raises(InvalidArgument, match="the prompt is 64 tokens"):
        prompt_token_ids(text("x" * 64), CharTokenizer(), MODEL)
    assert prompt_token_ids(text("x" * 20), CharTokenizer(), MODEL) == [ord("x")] * 20
