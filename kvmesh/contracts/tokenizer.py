"""Tokenizer (a `tokenizers` BPE + chat template + EOS ids) and incremental detokenization.

Imports no torch: the admission gateway uses this module to count and template prompts.
Reads Hugging Face folders (tokenizer.json, tokenizer_config.json, chat_template.jinja,
generation_config.json) and GGUF metadata (tokenizer.ggml.*).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from kvmesh.contracts.model_files import ModelLoadError, read_json, resolve_model_path

# GGUF token types (llama.cpp's llama_token_type).
GGUF_TOKEN_CONTROL = 3
GGUF_TOKEN_USER_DEFINED = 4

# llama.cpp pre-tokenizer names -> the pre-tokenizer that splits text the same way.
GPT2_REGEX_PRE = ("default", "gpt2", "gpt-2")
DIGIT_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r")
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe")
# Qwen2's (and Qwen2.5's, Qwen3's): Llama 3's split with single digits.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PRE = ("qwen2",)
# Pre-tokenizers that split the text by one regex, then byte-encode each piece.
SPLIT_PATTERNS = dict.fromkeys(LLAMA3_PRE, LLAMA3_PATTERN) | dict.fromkeys(QWEN2_PRE, QWEN2_PATTERN)

# How many prompt tokens the detokenizer decodes with the first output tokens, so tokenizers
# that drop a leading space at the start of a decode don't drop it from the output.
DETOKENIZER_CONTEXT = 5


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None,
        eos_token_ids: frozenset[int],
        bos_token: str | None,
        eos_token: str | None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.eos_token_ids = eos_token_ids
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = (
            None if bos_token is None else backend.token_to_id(bos_token)
        )
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        # The longest token as the vocabulary spells it (a byte-level token spells one
        # character per byte): no token stands for more text than this, so a text longer than
        # the context times this cannot fit the context, and is refused without encoding it.
        self.max_token_chars: int = max(
            (len(token) for token in backend.get_vocab(with_added_tokens=True)), default=1
        )
        self._template: jinja2.Template | None = (
            None if chat_template is None else _compile_chat_template(chat_template)
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no chat template); adds BOS only if the tokenizer does."""
        return list(self.backend.encode(text).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        return list(
            self.backend.encode(
                self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False
            ).ids
        )

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat template's text, rendered the way transformers renders it (tools: the
        OpenAI-style tool list, for templates that render it)."""
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain prompt")
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    @classmethod
    def from_model_path(cls, spec: str) -> Tokenizer:
        """The tokenizer of a folder, .gguf file or packaged model name, without its weights."""
        path = resolve_model_path(spec)
        if path.is_dir():
            return cls.from_hf_folder(path)
        import gguf  # numpy-only, but slow to import; only GGUF files need it

        return cls.from_gguf_fields(gguf.GGUFReader(path).fields, source=str(path))

    @classmethod
    def from_hf_folder(cls, folder: Path) -> Tokenizer:
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{folder} has no tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config_path = folder / "tokenizer_config.json"
        tok_config = read_json(config_path) if config_path.is_file() else {}
        bos_token = _token_content(tok_config.get("bos_token"))
        eos_token = _token_content(tok_config.get("eos_token"))
        eos_ids: set[int] = set()
        for json_name in ("config.json", "generation_config.json"):
            if (folder / json_name).is_file():
                eos_ids |= _as_id_set(read_json(folder / json_name).get("eos_token_id"))
        eos_token_id = None if eos_token is None else backend.token_to_id(eos_token)
        if eos_token_id is not None:
            eos_ids.add(eos_token_id)
        return cls(
            backend,
            chat_template=_hf_chat_template(folder, tok_config),
            eos_token_ids=frozenset(eos_ids),
            bos_token=bos_token,
            eos_token=eos_token,
        )

    @classmethod
    def from_gguf_fields(cls, fields: Any, *, source: str) -> Tokenizer:
        """Build the BPE tokenizer stored in GGUF metadata (`GGUFReader.fields`)."""

        def field(key: str, default: Any = None) -> Any:
            return fields[key].contents() if key in fields else default

        kind = field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(
                f"{source}: GGUF tokenizer model {kind!r} is not supported (only 'gpt2' BPE)"
            )
        tokens: list[str] = field("tokenizer.ggml.tokens")
        merges: list[str] = field("tokenizer.ggml.merges")
        if tokens is None or merges is None:
            raise ModelLoadError(
                f"{source}: GGUF lacks tokenizer.ggml.tokens / tokenizer.ggml.merges"
            )
        token_types: list[int] = field("tokenizer.ggml.token_type", [1] * len(tokens))
        backend = tokenizers.Tokenizer(
            models.BPE(
                vocab={token: i for i, token in enumerate(tokens)},
                merges=[_merge_pair(merge) for merge in merges],
                fuse_unk=False,
                byte_fallback=False,
            )
        )
        backend.pre_tokenizer = _gguf_pre_tokenizer(field("tokenizer.ggml.pre", "default"), source)
        backend.decoder = decoders.ByteLevel()
        backend.add_tokens(
            [
                AddedToken(tokens[i], special=kind_ == GGUF_TOKEN_CONTROL, normalized=False)
                for i, kind_ in enumerate(token_types)
                if kind_ in (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED)
            ]
        )
        bos_id = field("tokenizer.ggml.bos_token_id")
        eos_id = field("tokenizer.ggml.eos_token_id")
        bos_token = None if bos_id is None else tokens[bos_id]
        byte_level = processors.ByteLevel(trim_offsets=False)
        if field("tokenizer.ggml.add_bos_token", False) and bos_token is not None:
            backend.post_processor = processors.Sequence(
                [
                    byte_level,
                    processors.TemplateProcessing(
                        single=f"{bos_token}:0 $A:0",
                        pair=f"{bos_token}:0 $A:0 $B:1",
                        special_tokens=[(bos_token, bos_id)],
                    ),
                ]
            )
        else:
            backend.post_processor = byte_level
        eos_ids = {
            int(value)
            for key in ("eos_token_id", "eot_token_id", "eom_token_id")
            if (value := field(f"tokenizer.ggml.{key}")) is not None
        }
        return cls(
            backend,
            chat_template=field("tokenizer.chat_template"),
            eos_token_ids=frozenset(eos_ids),
            bos_token=bos_token,
            eos_token=None if eos_id is None else tokens[eos_id],
        )


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, one request at a time.

    Decodes only a small window (vLLM's prefix/read offsets), so each push costs O(new tokens),
    and holds back text that ends in U+FFFD (an incomplete UTF-8 character) until the bytes
    that complete it arrive."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        context = list(prompt_ids[-DETOKENIZER_CONTEXT:])
        self._ids = context
        self._prefix_offset = 0  # window start: decoded only to measure what was emitted
        self._read_offset = len(context)  # tokens before this are already emitted as text

    def push(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete (possibly "")."""
        self._ids.extend(token_ids)
        prefix_text = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self.tokenizer.decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Drop ids that can no longer be part of a window.
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of a request: any held-back text, even if it ends in U+FFFD."""
        prefix_text = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self.tokenizer.decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]


def _compile_chat_template(source: str) -> jinja2.Template:
    """Same environment transformers uses, so templates render identically."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _gguf_pre_tokenizer(pre: str, source: str) -> pre_tokenizers.PreTokenizer:
    if pre in GPT2_REGEX_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGIT_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if (pattern := SPLIT_PATTERNS.get(pre)) is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ModelLoadError(f"{source}: GGUF pre-tokenizer {pre!r} is not supported")


def _hf_chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template if isinstance(template, str) else None


def _merge_pair(merge: str) -> tuple[str, str]:
    left, right = merge.split(" ", 1)
    return left, right


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json holds special tokens as strings or {"content": ...} objects."""
    if isinstance(token, dict):
        return str(token["content"])
    return token if isinstance(token, str) else None


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}
