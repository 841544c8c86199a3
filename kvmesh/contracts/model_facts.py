"""What a backend that runs the weights itself (vLLM) needs to know of a Hugging Face folder.

Read from the files alone, for any architecture: the shape fields every decoder config has,
the tokenizer and chat template (kvmesh.contracts.tokenizer) and the fingerprint
(kvmesh.contracts.fingerprint, the same rule the native loader applies). No model is built
and no torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvmesh.contracts.fingerprint import folder_fingerprint
from kvmesh.contracts.model_files import ModelLoadError, model_name, read_json
from kvmesh.contracts.tokenizer import Tokenizer


@dataclass(slots=True, frozen=True)
class ModelFacts:
    """A model's name, tokenizer, fingerprint and the shape its KV cache has."""

    name: str
    tokenizer: Tokenizer
    fingerprint: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int


def read_model_facts(folder: Path, spec: str, dtype: str) -> ModelFacts:
    """The facts of a Hugging Face folder for an engine running `dtype` ("float32", ...)."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder} has no config.json")
    raw = read_json(config_path)
    try:
        num_heads = int(raw["num_attention_heads"])
        return ModelFacts(
            name=model_name(spec),
            tokenizer=Tokenizer.from_hf_folder(folder),
            fingerprint=folder_fingerprint(folder, dtype),
            vocab_size=int(raw["vocab_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // num_heads),
            max_position_embeddings=int(raw["max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{config_path} lacks the field {exc.args[0]!r}") from exc
