"""Qwen2 / Qwen2.5: Llama with a bias on the Q, K and V projections."""

from __future__ import annotations

from typing import Any

from services.worker.engine.models.family import ModelFamily
from services.worker.engine.models.llama import LlamaModel, ModelConfig, fuse_hf_weights


def read_qwen2_config(raw: dict[str, Any]) -> ModelConfig:
    refuse_layer_sliding_window(raw)
    return ModelConfig.from_hf_dict(
        raw, architecture="Qwen2ForCausalLM", model_type="qwen2", qkv_bias=True
    )


def refuse_layer_sliding_window(raw: dict[str, Any]) -> None:
    """Qwen's sliding window covers only the layers from max_window_layers on; the engine
    attends every layer alike, so such a checkpoint would be run wrongly."""
    if raw.get("use_sliding_window"):
        raise ValueError("use_sliding_window (a window on some layers only) is not supported")


FAMILY = ModelFamily(
    architecture="Qwen2ForCausalLM",
    model_type="qwen2",
    gguf_architecture="qwen2",
    gguf_rope_rows_interleaved=False,
    read_config=read_qwen2_config,
    model_class=LlamaModel,
    weight_mapping=fuse_hf_weights,
)
