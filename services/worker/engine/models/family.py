"""ModelFamily: what the engine needs to know of one architecture to load and run it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from services.worker.engine.models.llama import LlamaModel, ModelConfig


@dataclass(slots=True, frozen=True)
class ModelFamily:
    # Hugging Face config.json's architectures[0] (the registry's key) and model_type.
    architecture: str
    model_type: str
    # GGUF general.architecture of its files, None when llama.cpp has no such architecture.
    gguf_architecture: str | None
    # llama.cpp's converter wrote the Q/K rows with the rotary pairs interleaved (it does for
    # Llama, whose rotary it computes on adjacent pairs; not for Qwen, computed NeoX-style).
    gguf_rope_rows_interleaved: bool
    # config.json -> ModelConfig. ValueError names a setting the engine does not run; KeyError
    # a missing field.
    read_config: Callable[[dict[str, Any]], ModelConfig]
    model_class: type[LlamaModel]
    # Weights under Hugging Face names -> the model's parameters (KeyError names a missing one).
    weight_mapping: Callable[[ModelConfig, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
