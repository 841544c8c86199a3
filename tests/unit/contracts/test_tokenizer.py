"""Tokenizer (encode, chat template, EOS) and the incremental detokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from kvmesh.contracts.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.tiny_checkpoints import TINY_CORPUS, write_gguf_tokenizer

# Characters the tiny tokenizer never saw in training: each is several byte-level tokens.
MULTIBYTE_TEXT = "Hi 龍が好き 🦄🍕 naïve — ok 東京 🚀!"


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_path(str(tiny_llama_dir))


def test_encode_and_chat_template_match_transformers(
    tiny_tokenizer: Tokenizer, tiny_llama_dir: Path
) -> None:
    reference = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = "The quick brown fox, 12345 times."
    assert tiny_tokenizer.encode(text) == reference.encode(text)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ]
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        assert tiny_tokenizer.apply_chat_template(messages, add_generation_prompt) == expected
    assert tiny_tokenizer.eos_token_ids == frozenset(
        {reference.convert_tokens_to_ids("<|im_end|>")}
    )
    assert tiny_tokenizer.bos_token_id == reference.convert_tokens_to_ids("<|im_start|>")
    assert tiny_tokenizer.vocab_size == len(reference)


def test_decode_skips_special_tokens_unless_asked(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hey"}])
    assert "<|im_start|>" not in tiny_tokenizer.decode(ids)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>user")


def deltas_of(detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int) -> list[str]:
    return [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_detokenizer_never_splits_a_character(tiny_tokenizer: Tokenizer, chunk: int) -> None:
    ids = tiny_tokenizer.encode(MULTIBYTE_TEXT)
    # The test is only meaningful if single tokens carry partial characters.
    assert any("\ufffd" in tiny_tokenizer.decode([token]) for token in ids)
    deltas = deltas_of(IncrementalDetokenizer(tiny_tokenizer), ids, chunk)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == tiny_tokenizer.decode(ids) == MULTIBYTE_TEXT


def test_detokenizer_after_a_prompt_equals_decoding_the_output(tiny_tokenizer: Tokenizer) -> None:
    prompt = tiny_tokenizer.encode("Prompt ending in 龍")
    output = tiny_tokenizer.encode(" then 🦄 and text")
    detok = IncrementalDetokenizer(tiny_tokenizer, prompt_ids=prompt)
    assert "".join(deltas_of(detok, output, 1)) == tiny_tokenizer.decode(output)


def test_detokenizer_decodes_a_bounded_window(tiny_tokenizer: Tokenizer) -> None:
    """Each push decodes only a few recent tokens, however long the output grows."""
    window_sizes: list[int] = []
    original_decode = tiny_tokenizer.decode

    def spy(ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        window_sizes.append(len(ids))
        return original_decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tiny_tokenizer.encode(MULTIBYTE_TEXT * 20)
    detok = IncrementalDetokenizer(tiny_tokenizer)
    tiny_tokenizer.decode = spy  # type: ignore[method-assign]
    try:
        text = "".join(deltas_of(detok, ids, 1))
    finally:
        del tiny_tokenizer.decode
    assert text == MULTIBYTE_TEXT * 20
    assert len(ids) > 300 and max(window_sizes) <= 12


def test_flush_releases_a_dangling_partial_character(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.encode("ok 🦄")
    detok = IncrementalDetokenizer(tiny_tokenizer)
    emitted = "".join(deltas_of(detok, ids[:-1], 1))  # the unicorn's last byte never comes
    assert emitted.startswith("ok") and "\ufffd" not in emitted
    rest = detok.flush()
    assert rest.endswith("\ufffd")
    assert emitted + rest == tiny_tokenizer.decode(ids[:-1])


def test_gguf_tokenizer_loads_without_torch(smollm2_gguf_path: Path) -> None:
    """The admission gateway imports the tokenizer; it must not pull in torch."""
    code = (
        "import sys\n"
        "from kvmesh.contracts.tokenizer import Tokenizer\n"
        f"tok = Tokenizer.from_model_path({str(smollm2_gguf_path)!r})\n"
        "assert tok.encode('Hello world') == [19556, 905], tok.encode('Hello world')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "text",
    [MULTIBYTE_TEXT, "the quick brown fox " * 50, "a" * 5000, " " * 3000, "\n\n" + "🦄" * 300],
    ids=["multibyte", "words", "one-letter", "spaces", "emoji"],
)
def test_no_token_stands_for_more_text_than_max_token_chars(
    tiny_tokenizer: Tokenizer, text: str
) -> None:
    """What lets the gateway refuse a prompt by its length, without tokenizing it."""
    ids = tiny_tokenizer.encode(text)
    assert len(text) <= len(ids) * tiny_tokenizer.max_token_chars
    assert all(
        len(tiny_tokenizer.decode([i], skip_special_tokens=False)) <= tiny_tokenizer.max_token_chars
        for i in set(ids)
    )


def test_gguf_qwen2_pre_tokenizer_splits_as_transformers_qwen2_tokenizer(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """A GGUF tokenizer named "qwen2" (llama.cpp's name for Qwen2/2.5/3's split: single digits)
    encodes as transformers' Qwen2Tokenizer over the same vocabulary and merges."""
    import gguf
    from transformers import Qwen2Tokenizer

    path = tmp_path / "tokenizer.gguf"
    writer = gguf.GGUFWriter(path, "qwen2")
    write_gguf_tokenizer(writer, tiny_llama_dir, pre="qwen2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = Tokenizer.from_model_path(str(path))
    bpe = json.loads((tiny_llama_dir / "tokenizer.json").read_text())["model"]
    # Pairs, as tokenizers' BPE takes them (the annotation says strings).
    merges: Any = [tuple(pair) for pair in bpe["merges"]]
    reference = Qwen2Tokenizer(vocab=bpe["vocab"], merges=merges)
    texts = [*TINY_CORPUS, "In 2024, 12345 people said: it's 3.14!\n\n  Two   spaces\tand a tab."]
    for text in texts:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text
    # The split itself (the tiny vocabulary merges no digits): one piece per digit, where the
    # folder's GPT-2 split keeps the number whole.
    folder = Tokenizer.from_model_path(str(tiny_llama_dir))
    assert [len(pieces(tokenizer, "12345")) for tokenizer in (ours, folder)] == [5, 1]


def pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    return [piece for piece, _ in tokenizer.backend.pre_tokenizer.pre_tokenize_str(text)]
