"""Qwen3 (dense): Llama with an RMSNorm over each head of Q and K and an explicit head_dim."""

from __future__ import annotations

from typing import Any

from services.worker.engine.models.family import ModelFamily
from services.worker.engine.models.llama import LlamaModel, ModelConfig, fuse_hf_weights
from services.worker.engine.models.qwen2 import refuse_layer_sliding_window


def read_qwen3_config(raw: dict[str, Any]) -> ModelConfig:
    refuse_layer_sliding_window(raw)
    if raw.get("attention_bias"):
        raise ValueError("attention_bias Qwen3 checkpoints are not supported")
    return ModelConfig.from_hf_dict(
        raw, architecture="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True
    )


FAMILY = ModelFamily(
    architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    gguf_architecture="qwen3",
    gguf_rope_rows_interleaved=False,
    read_config=read_qwen3_config,
    model_class=LlamaModel,
    weight_mapping=fuse_hf_weights,
)
