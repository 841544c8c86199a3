"""The model registry: architecture name -> ModelFamily (model class, config reader, weight
mapping). Adding a family is one module beside this one and one line in FAMILIES.

Checkpoints of a kind the engine does not run (mixture-of-experts, multimodal, an architecture
not listed) are refused here with one line naming what is missing, before any weight is read.
"""

from __future__ import annotations

from typing import Any

from services.worker.engine.models import llama, mistral, qwen2, qwen3
from services.worker.engine.models.family import ModelFamily

FAMILIES: dict[str, ModelFamily] = {
    family.architecture: family
    for family in (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY)
}
GGUF_FAMILIES: dict[str, ModelFamily] = {
    family.gguf_architecture: family
    for family in FAMILIES.values()
    if family.gguf_architecture is not None
}
# config.json keys that mark a mixture-of-experts or a multimodal checkpoint, whatever its
# architecture is called.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
MULTIMODAL_KEYS = ("vision_config", "audio_config", "text_config")


class UnsupportedArchitecture(ValueError):
    """A checkpoint the engine does not run; the message names what is missing."""


def family_for_hf_config(raw: dict[str, Any]) -> ModelFamily:
    """The family of a Hugging Face config.json (by architectures[0], else model_type)."""
    architectures = raw.get("architectures") or []
    name = str(architectures[0]) if architectures else None
    if moe_key := next((key for key in MOE_KEYS if raw.get(key)), None):
        raise UnsupportedArchitecture(
            f"mixture-of-experts checkpoints ({name or raw.get('model_type')}, {moe_key}) "
            "are not supported"
        )
    if multimodal_key := next((key for key in MULTIMODAL_KEYS if key in raw), None):
        raise UnsupportedArchitecture(
            f"multimodal checkpoints ({name or raw.get('model_type')}, {multimodal_key}) "
            "are not supported"
        )
    if name is None:
        by_type = {family.model_type: family for family in FAMILIES.values()}
        if (family := by_type.get(raw.get("model_type"))) is not None:  # type: ignore[arg-type]
            return family
        name = f"model_type {raw.get('model_type')!r}"
    if name not in FAMILIES:
        raise UnsupportedArchitecture(
            f"architecture {name} is not supported (supported: {', '.join(FAMILIES)})"
        )
    return FAMILIES[name]


def family_for_gguf(architecture: str) -> ModelFamily:
    """The family of a GGUF file's general.architecture."""
    if architecture not in GGUF_FAMILIES:
        raise UnsupportedArchitecture(
            f"GGUF architecture {architecture!r} is not supported "
            f"(supported: {', '.join(GGUF_FAMILIES)})"
        )
    return GGUF_FAMILIES[architecture]
