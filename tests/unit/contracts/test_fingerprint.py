"""The model fingerprint rule (kvmesh.contracts.fingerprint), read from the files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kvmesh.contracts.fingerprint import (
    TensorBytes,
    canonical_config,
    fingerprint,
    folder_fingerprint,
)
from kvmesh.contracts.model_files import ModelLoadError

BASE = {
    "model_type": "qwen2",
    "vocab_size": 100,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
}
WEIGHT = [TensorBytes("w", "F32", (2,), b"\x00" * 8)]


def test_rope_spellings_and_shared_defaults_give_one_config() -> None:
    legacy = BASE | {"rope_theta": 5e5, "rope_scaling": None}
    v5 = BASE | {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    explicit = legacy | {"num_key_value_heads": 4, "head_dim": 16}
    assert canonical_config(legacy) == canonical_config(v5) == canonical_config(explicit)
    assert canonical_config(legacy)["rope_scaling"] is None
    scaled = legacy | {"rope_scaling": {"type": "linear", "factor": 2.0}}
    assert canonical_config(scaled)["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


def test_bookkeeping_keys_are_left_out_and_kv_keys_are_not() -> None:
    base = fingerprint(BASE, WEIGHT, "float32", "none")
    noted = BASE | {"transformers_version": "9.9", "use_cache": False, "bos_token_id": 3}
    assert fingerprint(noted, WEIGHT, "float32", "none") == base
    for changed in (
        {"rope_theta": 1e6},
        {"num_key_value_heads": 2},
        {"sliding_window": 64},
        {"model_type": "qwen3"},
    ):
        assert fingerprint(BASE | changed, WEIGHT, "float32", "none") != base
    assert fingerprint(BASE, WEIGHT, "bfloat16", "none") != base
    assert fingerprint(BASE, WEIGHT, "float32", "int8") != base
    other_bytes = [TensorBytes("w", "F32", (2,), b"\x00" * 7 + b"\x01")]
    assert fingerprint(BASE, other_bytes, "float32", "none") != base


def test_a_sharded_folder_has_the_single_folder_fingerprint(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_llama_dir, sharded)
    weights = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({name: weights[name] for name in part}, str(sharded / file))
    index = {"weight_map": {name: file for file, part in halves.items() for name in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert folder_fingerprint(sharded, "float32") == folder_fingerprint(tiny_llama_dir, "float32")
    (sharded / "b.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"b\.safetensors"):
        folder_fingerprint(sharded, "float32")


def test_an_unreadable_weight_file_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x05")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        folder_fingerprint(broken, "float32")
