"""Mistral: Llama with an optional sliding attention window (every layer alike)."""

from __future__ import annotations

from typing import Any

from services.worker.engine.models.family import ModelFamily
from services.worker.engine.models.llama import LlamaModel, ModelConfig, fuse_hf_weights


def read_mistral_config(raw: dict[str, Any]) -> ModelConfig:
    window = raw.get("sliding_window")
    if window is not None and int(window) < 1:
        raise ValueError(f"sliding_window must be >= 1 or null, got {window}")
    return ModelConfig.from_hf_dict(
        raw,
        architecture="MistralForCausalLM",
        model_type="mistral",
        sliding_window=None if window is None else int(window),
    )


FAMILY = ModelFamily(
    architecture="MistralForCausalLM",
    model_type="mistral",
    # llama.cpp writes Mistral checkpoints as its "llama" architecture (no window).
    gguf_architecture=None,
    gguf_rope_rows_interleaved=True,
    read_config=read_mistral_config,
    model_class=LlamaModel,
    weight_mapping=fuse_hf_weights,
)
